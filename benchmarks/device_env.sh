# Sourced (from the repository root) by benchmarks/device.sh and scripts/gpu_tests.sh on the GPU machine:
# installs every carried wheel (the dirs in $WHEEL_DIRS, default ".whl .whl-e2e", plus a wheel rebuilt by
# ../shared/tools/device-bigwheel.sh in /tmp/bigwheel) into /tmp/site in ONE pip call (the CuTe DSL's wheels
# share a top-level folder, so split installs break it), and exports the environment every GPU run uses: the
# checkout first on PYTHONPATH, then the wheels; unbuffered output; NVLink multicast off (KINDS.md).
_wheels=()
for _d in ${WHEEL_DIRS:-.whl .whl-e2e} /tmp/bigwheel; do
  for _w in "$_d"/*.whl; do [ -f "$_w" ] && _wheels+=("$_w"); done
done
if [ ${#_wheels[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${_wheels[@]}" 2>&1 | grep -v -i warning
fi
[ -d /tmp/site ] && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
# The CuTe DSL puts its modules on sys.path through a .pth file, which a --target install does not run.
[ -d /tmp/site/nvidia_cutlass_dsl/dsl_packages ] && export PYTHONPATH="$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset _wheels _d _w
