#!/usr/bin/env bash
# One budgeted device call for what is pending after the 2026-12-03 morning runs:
#   1. the calibration with the joint R/Q fit (issue #3: both targets' issue-time MAPE),
#   2. the MoE GPU tests with TMA descriptors as the kernel's default,
#   3. end-to-end NucleusMoE and FLUX with interleaved rounds (issue #8's noise-aware verdict),
#   4. (RUN_MOE_DEFAULT=1) the MoE kernel's default config against the pointer path (NucleusMoE shape).
# Wan runs in a call of its own right after this one (the device idles out after 30 s):
#   E2E_MODELS=wan E2E_COMPILE_MODELS=wan E2E_WAN_ROUNDS=2 E2E_TOTAL_S=400 E2E_WAN_S=360 E2E_COMPILE_ESTIMATE_S=15 \
#     OUT=$OUT XSTAGE_GIT_COMMIT=sha bash benchmarks/run_e2e_gpu.sh
# Each step has its own time limit, so a slow step cannot starve the later ones; everything lands in
# $OUT/pending.tgz plus the e2e tables (at most 8 files come back from a device call).
#   OUT=dir XSTAGE_GIT_COMMIT=sha bash benchmarks/run_pending_gpu.sh      (carry .whl)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-.gpu_out}"; P="$OUT/pending"; mkdir -p "$P"
. benchmarks/device_env.sh
export XSTAGE_DIT_CACHE=/tmp/xstage-cache
pack() { tar -czf "$OUT/pending.tgz" -C "$OUT" pending; }

echo "== 1. calibration (joint R/Q fit)"
OUT="$P/cal" timeout "${CAL_S:-80}" bash benchmarks/run_calibration_gpu.sh > "$P/cal.log" 2>&1
echo "exit $?"
python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['summary'], indent=1))" \
  "$P/cal/calibration-h200-1gpu.json" 2>&1 | head -40
pack

echo "== 2. MoE GPU tests (TMA descriptors by default)"
timeout "${TEST_S:-110}" python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/test_moe_gpu.py \
  > "$P/gpu-tests.log" 2>&1
echo "exit $?"; grep -E "FAILED|passed|failed" "$P/gpu-tests.log" | tail -5
pack

echo "== 3. e2e NucleusMoE and FLUX (interleaved rounds)"
E2E_MODELS="${E2E_MODELS:-nucleusmoe flux}" E2E_COMPILE_MODELS="${E2E_COMPILE_MODELS:-nucleusmoe flux}" \
  E2E_TOTAL_S="${E2E_TOTAL_S:-370}" E2E_NUCLEUS_S="${E2E_NUCLEUS_S:-90}" E2E_FLUX_S="${E2E_FLUX_S:-270}" \
  OUT="$OUT" bash benchmarks/run_e2e_gpu.sh > "$P/e2e.log" 2>&1
echo "exit $?"; grep -E "^\[bench\]" "$P/e2e.log" | tail -30
pack

[ "${RUN_MOE_DEFAULT:-0}" = "1" ] || exit 0
echo "== 4. MoE default config (NucleusMoE shape)"
timeout "${MOE_S:-50}" python3 benchmarks/bench_moe_combine.py --shapes nucleusmoe --worlds 1,4 --leads 0,2 \
  --configs default,m128n128n128k64w8s3 --budget-s "${MOE_BUDGET_S:-40}" --out "$P/moe-default-h200" \
  > "$P/moe-default.log" 2>&1
echo "exit $?"; tail -12 "$P/moe-default-h200.md" 2>/dev/null
pack
