#!/usr/bin/env bash
# One device call: build the burst kernel, run the GPU + CPU calibration tests, the full calibration
# (local + host), the quick-calibration and cache-load timings, the peer path on a shared GPU.
# Usage (repo root on the GPU machine): OUT=dir XSTAGE_GIT_COMMIT=sha bash benchmarks/run_calibration_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XSTAGE_DIT_CACHE=/tmp/xstage-cache NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-out}"; mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  nvcc --version | tail -1
  echo "== build (first use)"
  python3 -c "
import time, torch
t0 = time.perf_counter()
from xstage_dit.calibration.csrc.burst import library_for
lib = library_for(torch.device('cuda', 0))
print(f'built+loaded {lib.path} in {time.perf_counter() - t0:.2f} s')"
  echo "== tests"
  timeout 70 python3 -m pytest -q tests/test_calibration_gpu.py -p no:cacheprovider
  echo "== benchmark"
  timeout 110 python3 benchmarks/bench_calibration.py --out "$OUT" --prefix calibration-h200-1gpu --targets local,host ${PEER:+--peer-shared-gpu}
} 2>&1 | tee "$OUT/calibration-h200-1gpu.log"
