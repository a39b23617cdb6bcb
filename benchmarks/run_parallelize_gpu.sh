#!/usr/bin/env bash
# One device call for parallelize: the GPU tests (world 1 fused/serial vs diffusers, 2 ranks sharing the GPU)
# and bench_parallelize_flux.py (full FLUX step at 1024^2). Expects diffusers importable (carried wheels).
# Usage (repo root on the GPU machine): OUT=dir XSTAGE_COMMIT=sha bash benchmarks/run_parallelize_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRANSFORMERS_VERBOSITY=error
OUT="${OUT:-out}"; mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton, diffusers; print('torch', torch.__version__, 'triton', triton.__version__, 'diffusers', diffusers.__version__)"
  echo "== GPU tests"
  timeout 55 python3 -m pytest -q tests/test_parallelize_gpu.py -p no:cacheprovider -x
  echo "== benchmark"
  timeout 118 python3 benchmarks/bench_parallelize_flux.py --out "$OUT" --commit "${XSTAGE_COMMIT:-unknown}" --reps 5 --w2-timeout 55
} 2>&1 | tee "$OUT/parallelize-flux-h200.log"
