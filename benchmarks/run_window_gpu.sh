#!/usr/bin/env bash
# Device runner for the peer-window work (issue 14), named steps in the order given:
#   stash    call 1 of shared/tools/device-bigwheel.sh: keep ../.whl-a halves and ../.whl wheels in /tmp/bigwheel
#   install  call 2: join the big wheel, install every carried wheel (+ ../.whl-fe) in ONE pip call into /tmp/site
#   tests    the window GPU tests (+ the Ulysses GPU tests: the Triton epilogue changed)
#   bench    bench_attention_a2a.py --window (BENCH_ARGS adds options)
# Run from the tree root copied to the device; outputs under ${OUT:-/tmp/out}.
#   bash benchmarks/run_window_gpu.sh stash tests        (carry .whl-a .whl)
#   bash benchmarks/run_window_gpu.sh install tests bench (carry .whl-b .whl-fe)
set -u
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/out}"
mkdir -p "$out"
parent="${WHEEL_ROOT:-..}"
site=/tmp/site
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The CuTe DSL wheels add dsl_packages through a .pth file, which a --target install does not run.
export PYTHONPATH="$PWD:$site:$site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
export XSTAGE_GIT_COMMIT="$(cat COMMIT 2>/dev/null || echo unknown)"
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case "$step" in
    stash)
      mkdir -p /tmp/bigwheel && cp "$parent"/.whl-a/* "$parent"/.whl/*.whl /tmp/bigwheel/ && ls /tmp/bigwheel ;;
    install)
      for b in "$parent"/.whl-b/*.part-ab; do
        n=$(basename "$b" .part-ab)
        [ -f "/tmp/bigwheel/$n.part-aa" ] || { echo "no stash on this machine: run 'stash' first"; exit 3; }
        cat "/tmp/bigwheel/$n.part-aa" "$b" > "/tmp/bigwheel/$n"
      done
      cp "$parent"/.whl-fe/*.whl /tmp/bigwheel/ 2>/dev/null
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
          /tmp/bigwheel/*.whl 2>&1 | grep -v -i warning
      python3 -c "import flash_attn.cute, cudnn, torch; print('fa4 ok; cudnn backend', cudnn.backend_version(), 'torch cudnn', torch.backends.cudnn.version())" ;;
    tests)
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
      timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -rs --tb=short -p no:cacheprovider -o addopts="" \
          tests/ops/test_attention_window_gpu.py ${EXTRA_TESTS:-} 2>&1 | tee "$out/window_gpu_tests.log" | tail -40 ;;
    bench)
      timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/bench_attention_a2a.py --window --out-dir "$out" \
          --commit "$XSTAGE_GIT_COMMIT" ${BENCH_ARGS:-} 2>&1 | tee "$out/window_bench.log" | tail -60
      cp "$out"/attention/* "$out"/ 2>/dev/null ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
