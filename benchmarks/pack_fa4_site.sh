#!/usr/bin/env bash
# FlashAttention-4 and the CuTe DSL as ONE pre-installed site folder, xz-packed small enough for one device call.
#
#   bash benchmarks/pack_fa4_site.sh .whl-a .whl-b .whl-fe .whl-s1     # -> .whl-fa4/fa4-site.tar.xz
#
# Why: the CuTe DSL's CUDA-13 wheel is 92 MB (its MLIR library alone is 193 MB unpacked, already stripped), over
# the 64 MiB a device call carries, so it travelled in two calls (device.sh fa4-stash, then fa4-install on the
# same machine within its ~30 s of idle warmth, or the stash was gone and a fresh machine's start was paid again).
# xz with the x86 branch filter and a dictionary as large as the folder packs what pip installs from those wheels
# (264 MB) into ~60 MB: one call, carry [".whl-fa4"] with WHEEL_DIRS=none; benchmarks/device_env.sh unpacks it
# into /tmp/site once per machine (Python's lzma: no xz binary needed there).
# Arguments: wheel files, or folders holding wheels and the halves device-bigwheel.sh split (*.part-aa/-ab),
# joined here. The wheels are installed for CPython 3.12 / manylinux_2_28 x86_64 (the device's Python), with
# pip's --target, as device_env.sh would install them; packing takes ~4 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 WHEEL_OR_DIR..." >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/wheels" "$work/site" .whl-fa4
grep -qx "/.whl-fa4/" .git/info/exclude 2>/dev/null || echo "/.whl-fa4/" >> .git/info/exclude
for arg in "$@"; do
  if [ -d "$arg" ]; then
    for w in "$arg"/*.whl; do [ -f "$w" ] && cp "$w" "$work/wheels/"; done
    for a in "$arg"/*.part-aa; do [ -f "$a" ] && cp "$a" "$work/wheels/"; done
    for b in "$arg"/*.part-ab; do [ -f "$b" ] && cp "$b" "$work/wheels/"; done
  else
    cp "$arg" "$work/wheels/"
  fi
done
for a in "$work"/wheels/*.part-aa; do
  [ -f "$a" ] || continue
  name=$(basename "$a" .part-aa)
  [ -f "$work/wheels/$name.part-ab" ] || { echo "missing the second half of $name" >&2; exit 1; }
  cat "$a" "$work/wheels/$name.part-ab" > "$work/wheels/$name"
  rm -f "$a" "$work/wheels/$name.part-ab"
done
python3 -m pip install -q --no-index --no-deps --no-compile --target "$work/site" --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --only-binary=:all: "$work"/wheels/*.whl 2>&1 | grep -v -i warning || true
python3 -c "import sys, pathlib; site = pathlib.Path(sys.argv[1]); \
assert (site / 'flash_attn' / 'cute').is_dir() and (site / 'nvidia_cutlass_dsl').is_dir(), 'FA4 or the CuTe DSL missing'" "$work/site"
ls "$work/wheels" > "$work/site/.fa4-site-wheels"
tar cf - -C "$work/site" --sort=name --owner=0 --group=0 --mtime=@0 . \
  | xz --x86 --lzma2=preset=9e,dict=256MiB -T1 > .whl-fa4/fa4-site.tar.xz.tmp
mv .whl-fa4/fa4-site.tar.xz.tmp .whl-fa4/fa4-site.tar.xz
echo "$(du -b .whl-fa4/fa4-site.tar.xz | cut -f1) bytes: .whl-fa4/fa4-site.tar.xz ($(wc -l < "$work/site/.fa4-site-wheels") wheels)"
