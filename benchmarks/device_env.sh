# Sourced (from the repository root) by the one-call device scripts: installs the wheels carried in ./.whl
# into /tmp/site and exports the environment every GPU run here uses: the checkout first on PYTHONPATH,
# then the carried wheels; unbuffered output; NVLink multicast off (KINDS.md).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    2>&1 | grep -v -i warning
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRANSFORMERS_VERBOSITY=error
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
