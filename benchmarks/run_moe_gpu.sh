#!/usr/bin/env bash
# One GPU run of the MoE work: benchmark (JSON + Markdown under $OUT or benchmarks/results) and GPU tests.
# On the device machine (no diffusers there) install the carried wheels first, e.g.
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-benchmarks/results}"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
timeout 128 python3 benchmarks/bench_moe_combine.py --out "$OUT_DIR/moe-combine-h200" --budget-s 100 --leads 0,1,2,3 \
  --configs m128n128n128k64w8s3,m128n128n128k64w8s3-static,m128n64n256k64w8s3,m128n64n128k64w8s3 2>&1 | tee "$OUT_DIR/bench.log" | grep -v "^    "
timeout 75 python3 -m pytest -q -p no:cacheprovider tests/test_moe_gpu.py 2>&1 | tee "$OUT_DIR/gpu_tests.log" | tail -25
# Multi-GPU (when a kind with N GPUs is lent): serial vs fused vs interleaved on real ranks.
#   torchrun --nproc-per-node N benchmarks/bench_moe_ep.py --out "$OUT_DIR/moe-ep-h200xN"
