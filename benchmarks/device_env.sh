# Sourced (from the repository root) by benchmarks/device.sh and scripts/gpu_tests.sh on the GPU machine:
# installs every carried wheel (the dirs in $WHEEL_DIRS, default ".whl .whl-e2e", plus a wheel rebuilt by
# ../shared/tools/device-bigwheel.sh in /tmp/bigwheel) into /tmp/site in ONE pip call (the CuTe DSL's wheels
# share a top-level folder, so split installs break it), and exports the environment every GPU run uses: the
# checkout first on PYTHONPATH, then the wheels; unbuffered output; NVLink multicast off (KINDS.md).
#
# What the device lacks (2026-12-04), fetched here into .whl (12.6 MB, under the 64 MiB a call carries):
#   ../shared/tools/device-wheels.sh diffusers==0.42.1 transformers==5.17.0 fastapi==0.165.0 uvicorn==0.55.0 \
#       ftfy prometheus-client==0.26.0 fastapi-offline==1.7.7 zlib-ng==1.1.0 peft==0.21.2 && rm -f .whl/nvidia_*
#   (peft: diffusers' LoRA loaders, xstage_dit/features/lora; added 2026-12-06 with issue 40)
#   plus, with pip download --no-deps: xfuser==0.7.0 beautifulsoup4 soupsieve distvae yunchang (the bench's peer).
# FlashAttention-4 (flash-attn-4==4.0.0b36, nvidia-cutlass-dsl{,-libs-base,-libs-core,-libs-cu13}==4.8.1,
# apache-tvm-ffi, torch-c-dlpack-ext, quack-kernels==0.6.5) travels in ONE call as .whl-fa4/fa4-site.tar.xz
# (`bash benchmarks/pack_site.sh fa4 ...`, below); before 2026-12-05 in two calls: split the 92 MB cu13 wheel
# with ../shared/tools/device-bigwheel.sh, carry [.whl-a, .whl] for `device.sh fa4-stash ...`, then at once
# [.whl-b, .whl-fe] (the small FA4 wheels in .whl-fe) for `device.sh fa4-install ...`; nvidia-cudnn-frontend
# (11.6 MB) in a third call's WHEEL_DIRS. Never carry one wheel in two dirs: pip refuses the duplicate.
# Sizes (2026-12-05): a call carries 64 MiB including the checkout (5.7 MB now): call 1 carries [.whl, .whl-a]
# (62.7 MiB) for `device.sh fa4-stash`, call 2 [.whl-b, .whl-fe, .whl-s1] (apache_tvm_ffi in .whl-s1) for
# `device.sh fa4-install`, which copies .whl-s1 into the stash itself; cudnn-frontend fits neither (its own
# call, WHEEL_DIRS=.whl-cudnn).
# Video served rows (/v1/videos answers MP4) need imageio-ffmpeg==0.7.0 (29.5 MB, the ffmpeg binary inside):
# `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl-video
# imageio-ffmpeg==0.7.0`, carried in a call of its own size budget (WHEEL_DIRS=".whl .whl-video").
# Packed sites (benchmarks/pack_site.sh): FlashAttention-4 + the CuTe DSL as .whl-fa4/fa4-site.tar.xz (~60 MB),
# Ray + the server's wheels as .whl-rayserve/rayserve-site.tar.xz (40 MB). Carry the folder (WHEEL_DIRS=none where
# .whl does not fit beside it); each is unpacked into /tmp/site once per machine, and a later call on the warm
# machine finds the same archive's checksum there and skips the unpacking.
for _pack in .whl-*/*-site.tar.xz; do
  [ -f "$_pack" ] || continue
  _sum=$(cksum < "$_pack")
  _mark="/tmp/site/.$(basename "$_pack" .tar.xz)-packed"
  if [ "$(cat "$_mark" 2>/dev/null)" != "$_sum" ]; then
    mkdir -p /tmp/site
    if python3 - "$_pack" /tmp/site <<'PYEOF'
import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as archive:  # the device's Python: lzma is built in, no xz binary needed
    archive.extractall(sys.argv[2], **({"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}))
PYEOF
    then echo "$_sum" > "$_mark"
    else echo "[device_env] unpacking $_pack failed" >&2
    fi
  fi
done
unset _pack _sum _mark
_wheels=()
for _d in ${WHEEL_DIRS:-.whl .whl-e2e} /tmp/bigwheel; do
  for _w in "$_d"/*.whl; do [ -f "$_w" ] && _wheels+=("$_w"); done
done
if [ ${#_wheels[@]} -gt 0 ]; then
  # Into a fresh folder, then merged: `pip --target --upgrade` replaces a top-level folder whole, so a wheel with a
  # namespace folder (protobuf's google/) wiped what the packed site had there (google/rpc: Ray's raylet then
  # timed out, 2026-12-07). A regular package (an __init__.py) and an older dist-info of a project are replaced.
  _new=$(mktemp -d /tmp/site-new.XXXXXX)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$_new" \
    "${_wheels[@]}" 2>&1 | grep -v -i warning
  python3 - "$_new" /tmp/site <<'PYEOF'
import re, shutil, sys
from pathlib import Path
new, site = Path(sys.argv[1]), Path(sys.argv[2])
site.mkdir(parents=True, exist_ok=True)
project = lambda name: re.sub(r"[-_.]+", "_", name.split("-")[0]).lower()
def merge(src: Path, dst: Path) -> None:
    for item in src.iterdir():
        target = dst / item.name
        if item.is_dir() and target.is_dir() and not (item / "__init__.py").exists():
            merge(item, target)  # a namespace folder: keep what other distributions put there
            continue
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        shutil.move(str(item), str(target))
for info in new.glob("*.dist-info"):
    for old in site.glob("*.dist-info"):
        if project(old.name) == project(info.name):
            shutil.rmtree(old)
merge(new, site)
PYEOF
  rm -rf "$_new"
fi
[ -d /tmp/site ] && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
# The CuTe DSL puts its modules on sys.path through a .pth file, which a --target install does not run.
[ -d /tmp/site/nvidia_cutlass_dsl/dsl_packages ] && export PYTHONPATH="$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset _wheels _d _w
