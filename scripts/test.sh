#!/usr/bin/env bash
# Installs everything into ./.venv (first run only) and runs the test suite on the CPU.
# GPU tests are skipped, and counted, without a GPU. Extra arguments go to pytest.
set -e
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/env.sh"
cd "$root"
# Quiet by default, but only once: a second -q (pytest's -qq) drops the closing "N passed" line.
verbosity=(-q)
for arg in "$@"; do
  case "$arg" in
    -q|--quiet|-qq|-v|--verbose|-vv|-vvv|--verbosity=*) verbosity=() ;;
  esac
done
exec python -m pytest "${verbosity[@]}" "$@"
