#!/usr/bin/env bash
# One budgeted device call for what the 2026-12-03 session could not run on the GPU (device time ran out):
#   1. the calibration with aligned bursts (SWEEP_VERSION 2; issue #3's host issue-time MAPE),
#   2. the GPU tests changed since their last run (attention launch from a fresh thread; the MoE file),
#   3. the MoE TMA-descriptor configurations against the current best (issue #5's 1.2x target),
#   4. end-to-end NucleusMoE and Wan with the calibrated schedule and torch.compile (issue #8's missing rows).
# Each step has its own time limit, so a slow step cannot starve the later ones; everything lands in
# $OUT/pending.tgz plus the e2e tables (at most 8 files come back from a device call).
#   OUT=dir XSTAGE_GIT_COMMIT=sha bash benchmarks/run_pending_gpu.sh      (carry .whl)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-.gpu_out}"; P="$OUT/pending"; mkdir -p "$P"
. benchmarks/device_env.sh
export XSTAGE_DIT_CACHE=/tmp/xstage-cache
pack() { tar -czf "$OUT/pending.tgz" -C "$OUT" pending; }

echo "== 1. calibration (aligned bursts)"
OUT="$P/cal" timeout "${CAL_S:-100}" bash benchmarks/run_calibration_gpu.sh > "$P/cal.log" 2>&1
echo "exit $?"
python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['summary'], indent=1))" \
  "$P/cal/calibration-h200-1gpu.json" 2>&1 | head -40
pack

echo "== 2. GPU tests changed since 3d48bf5"
timeout "${TEST_S:-100}" python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu \
  tests/test_ulysses_attention_gpu.py::test_fused_kernel_launches_from_a_fresh_thread tests/test_moe_gpu.py \
  > "$P/gpu-tests.log" 2>&1
echo "exit $?"; grep -E "FAILED|passed|failed" "$P/gpu-tests.log" | tail -5
pack

echo "== 3. MoE TMA configurations (NucleusMoE shape)"
timeout "${MOE_S:-140}" python3 benchmarks/bench_moe_combine.py --shapes nucleusmoe --worlds 1,4 --leads 0,2 \
  --configs m128n128n128k64w8s3,m128n128n128k64w8s3-static,m128n128n128k64w8s3-desc,m128n128n128k64w8s3-desc-static,m128n128n128k64w8s4-desc,m128n128n128k64w8s4-desc-static,m128n128n128k128w8s2-desc,m128n64n128k64w8s4-desc \
  --budget-s "${MOE_BUDGET_S:-110}" --out "$P/moe-tma-h200" > "$P/moe-tma.log" 2>&1
echo "exit $?"; tail -16 "$P/moe-tma-h200.md" 2>/dev/null
pack

echo "== 4. e2e NucleusMoE and Wan (calibrated schedule, torch.compile)"
E2E_MODELS="${E2E_MODELS:-nucleusmoe wan}" E2E_COMPILE_MODELS="${E2E_COMPILE_MODELS:-nucleusmoe wan}" \
  E2E_TOTAL_S="${E2E_TOTAL_S:-230}" E2E_NUCLEUS_S="${E2E_NUCLEUS_S:-90}" E2E_WAN_S="${E2E_WAN_S:-120}" \
  OUT="$OUT" bash benchmarks/run_e2e_gpu.sh > "$P/e2e.log" 2>&1
echo "exit $?"; grep -E "^\[bench\]" "$P/e2e.log" | tail -24
pack
