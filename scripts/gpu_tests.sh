#!/usr/bin/env bash
# Runs the GPU-marked tests (`pytest -m "gpu or multigpu"`) on a GPU machine and writes a report.
#
#   scripts/gpu_tests.sh                      # every gpu/multigpu test
#   scripts/gpu_tests.sh tests/families         # only some files (extra arguments go to pytest)
#   scripts/gpu_tests.sh --multi              # only the multigpu tests (NCCL serial attention, the fused
#                                             # path and EP between separate GPUs, the NVLink peer target)
#
# No virtualenv there: uses the machine's python3 (or $PYTHON). Carried wheels (.whl, .whl-e2e: diffusers...)
# are installed first by benchmarks/device_env.sh. Writes to ${OUT:-.gpu_out}:
#   gpu-tests.xml (JUnit), gpu-tests.txt (pytest output, then nvidia-smi and versions).
# Exit status: pytest's (0 only when every selected test passed; a run that selects no test fails).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
out="${OUT:-$root/.gpu_out}"
mkdir -p "$out"
# The one device environment: carried wheels installed, the checkout on PYTHONPATH, NVLink multicast off.
# shellcheck disable=SC1091
. "$root/benchmarks/device_env.sh"
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_tests.sh: no CUDA GPU visible to $py; the gpu tests would all be skipped" >&2
  exit 4
fi
marker="gpu or multigpu"
if [ "${1:-}" = "--multi" ]; then
  shift
  marker="multigpu"
  "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)" \
    || { echo "gpu_tests.sh --multi: needs >= 2 GPUs, found fewer" >&2; exit 4; }
fi
# The OpenAPI fuzzing module holds no GPU test and needs schemathesis, a CPU-only test tool the GPU machine
# lacks: leave it out of collection there instead of failing the run on its import.
extra=()
if ! "$py" -c "import schemathesis" 2>/dev/null; then
  extra+=(--ignore=tests/server/test_openapi_fuzz.py)
  echo "gpu_tests.sh: schemathesis not installed: tests/server/test_openapi_fuzz.py (CPU only) not collected" >&2
fi
report="$out/gpu-tests.txt"
"$py" -m pytest -m "$marker" -p no:cacheprovider -o addopts="" -rA --timeout=600 \
  --junitxml="$out/gpu-tests.xml" "${extra[@]}" "$@" 2>&1 | tee "$report"
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
