#!/usr/bin/env bash
# Wheels too large for one device call as ONE pre-installed site folder, xz-packed: .whl-NAME/NAME-site.tar.xz.
#
#   bash benchmarks/pack_site.sh fa4 --check flash_attn/cute --check nvidia_cutlass_dsl .whl-a .whl-b .whl-fe .whl-s1
#   bash benchmarks/pack_site.sh rayserve --check ray/serve --drop ray/jars --drop ray/rllib \
#       --drop ray/dashboard/client .whl-ray-a .whl-ray-b .whl-ray .whl-ray-big1 .whl-ray-big2 .whl
#
# Why: a call carries 64 MiB. The CuTe DSL's CUDA-13 wheel is 92 MB and Ray's 79 MB, so each travelled in two or
# three calls (halves stashed on one machine, which had to stay warm between them: ~30 s of idle, else a fresh
# start and the stash gone). xz with the x86 branch filter and a dictionary as large as the folder packs what pip
# installs: FA4 + the CuTe DSL (264 MB) into ~60 MB; Ray with the server's wheels, less what a Serve application
# never loads (--drop: Ray's Java jars, RLlib, the dashboard's web page), into 40 MB. Carry [".whl-NAME"] with
# WHEEL_DIRS=none; benchmarks/device_env.sh unpacks every carried .whl-*/*-site.tar.xz into /tmp/site once per
# machine (Python's lzma: no xz binary needed there).
# Arguments: NAME, then --check PATH (must exist in the site, else the pack fails) and --drop PATH (removed from
# the site) any number of times, then wheel files or folders holding wheels and the halves device-bigwheel.sh
# split (*.part-aa/-ab), joined here. Installed for CPython 3.12 / manylinux_2_28 x86_64 (the device's Python)
# with pip's --target, as device_env.sh would install them; packing takes minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 NAME [--check PATH]... [--drop PATH]... WHEEL_OR_DIR..." >&2; exit 2; }
name=$1; shift
checks=(); drops=()
while [ $# -gt 0 ]; do
  case $1 in
    --check) checks+=("$2"); shift 2 ;;
    --drop) drops+=("$2"); shift 2 ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || { echo "$0: no wheels given" >&2; exit 2; }
out=".whl-$name"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/wheels" "$work/site" "$out"
grep -qx "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >> .git/info/exclude
for arg in "$@"; do
  if [ -d "$arg" ]; then
    for w in "$arg"/*.whl "$arg"/*.part-aa "$arg"/*.part-ab; do [ -f "$w" ] && cp "$w" "$work/wheels/"; done
  else
    cp "$arg" "$work/wheels/"
  fi
done
for a in "$work"/wheels/*.part-aa; do
  [ -f "$a" ] || continue
  whl=$(basename "$a" .part-aa)
  [ -f "$work/wheels/$whl.part-ab" ] || { echo "missing the second half of $whl" >&2; exit 1; }
  cat "$a" "$work/wheels/$whl.part-ab" > "$work/wheels/$whl"
  rm -f "$a" "$work/wheels/$whl.part-ab"
done
platforms=()  # pip takes only the tags it is given: the device's glibc 2.28+ and every older manylinux
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip install -q --no-index --no-deps --no-compile --target "$work/site" --python-version 3.12 \
  "${platforms[@]}" --only-binary=:all: "$work"/wheels/*.whl 2>&1 | grep -v -i warning || true
for path in "${checks[@]}"; do
  [ -e "$work/site/$path" ] || { echo "$path missing from the installed site" >&2; exit 1; }
done
for path in "${drops[@]}"; do rm -rf "${work:?}/site/$path"; done
ls "$work/wheels" > "$work/site/.$name-site-wheels"
tar cf - -C "$work/site" --sort=name --owner=0 --group=0 --mtime=@0 . \
  | xz --x86 --lzma2=preset=9e,dict=256MiB -T1 > "$out/$name-site.tar.xz.tmp"
mv "$out/$name-site.tar.xz.tmp" "$out/$name-site.tar.xz"
wheels=$(wc -l < "$work/site/.$name-site-wheels")
echo "$(du -b "$out/$name-site.tar.xz" | cut -f1) bytes: $out/$name-site.tar.xz ($wheels wheels)"
