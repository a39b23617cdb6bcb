#!/usr/bin/env bash
# Runs the GPU-marked tests (`pytest -m "gpu or multigpu"`) on a GPU machine and writes a report.
#
#   scripts/gpu_tests.sh                      # every gpu/multigpu test
#   scripts/gpu_tests.sh tests/test_models.py # only some files (extra arguments go to pytest)
#
# No virtualenv there: uses the machine's python3 (or $PYTHON). Wheels carried in ./.whl (diffusers...)
# are installed into a temporary folder first when present. Writes to ${OUT:-.gpu_out}:
#   gpu-tests.xml (JUnit), gpu-tests.txt (pytest output, then nvidia-smi and versions).
# Exit status: pytest's (0 only when every selected test passed; a run that selects no test fails).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
out="${OUT:-$root/.gpu_out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if compgen -G ".whl/*.whl" >/dev/null; then
  site="$(mktemp -d)"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
    || { echo "gpu_tests.sh: installing .whl/*.whl failed" >&2; exit 3; }
  export PYTHONPATH="$site:$root${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_tests.sh: no CUDA GPU visible to $py; the gpu tests would all be skipped" >&2
  exit 4
fi
report="$out/gpu-tests.txt"
"$py" -m pytest -m "gpu or multigpu" -p no:cacheprovider -o addopts="" -rA --timeout=600 \
  --junitxml="$out/gpu-tests.xml" "$@" 2>&1 | tee "$report"
status=${PIPESTATUS[0]}
{
  echo
  echo "== exit status: $status"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
  "$py" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  "$py" -c "import diffusers; print('diffusers', diffusers.__version__)" 2>/dev/null
  echo "commit ${XSTAGE_GIT_COMMIT:-$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)}"
} >> "$report"
echo "gpu_tests.sh: report in $report, JUnit XML in $out/gpu-tests.xml (exit $status)"
exit "$status"
