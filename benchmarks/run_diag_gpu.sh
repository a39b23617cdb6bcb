#!/usr/bin/env bash
# One device call of diagnoses and the calibration re-run:
#   1. fused attention per shape x kernel config (which configs are correct at head_dim 64),
#   2. NucleusMoE EP over two processes sharing the GPU vs one process (where the difference comes from),
#   3. the calibration (benchmarks/run_calibration_gpu.sh: tests, full local+host calibration, quick, cache).
# Everything lands in $OUT/diag.tgz (at most 8 files come back from a device call) plus the short logs.
#   OUT=dir XSTAGE_GIT_COMMIT=sha bash benchmarks/run_diag_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/device_env.sh
OUT="${OUT:-.gpu_out}"; mkdir -p "$OUT/diag"
D="$OUT/diag"
if [ "${ATTN:-1}" = 1 ]; then
  echo "== attention configs"
  timeout "${ATTN_S:-150}" python3 benchmarks/diag_attention_configs.py --out "$D/diag_attention.json" > "$D/diag_attention.log" 2>&1
  echo "exit $?"; grep -c '"nan_elems": 0' "$D/diag_attention.log"; grep -v '"nan_elems": 0' "$D/diag_attention.log" | cut -c1-400 | head -40
fi
echo "== MoE two processes"
timeout "${MOE_S:-200}" python3 benchmarks/diag_moe_two_procs.py --out "$D/diag_moe.json" > "$D/diag_moe.log" 2>&1
echo "exit $?"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d.get('0', d), default=str)[:7000])" "$D/diag_moe.json"
if [ "${CAL:-1}" = 1 ]; then
  echo "== calibration"
  OUT="$D" timeout "${CAL_S:-200}" bash benchmarks/run_calibration_gpu.sh > "$D/cal_wrapper.log" 2>&1
  echo "exit $?"; grep -E "passed|failed|R_GBps|mape|MAPE|quick|cache|drain" "$D/calibration-h200-1gpu.log" | head -30
fi
tar -czf "$OUT/diag.tgz" -C "$OUT" diag
ls -la "$D"
