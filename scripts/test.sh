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
# Two test processes by default (pytest-xdist; the CI machine has 2 cores), whole files to a process so a module's
# server or pipeline fixture is built once, in the order tests/conftest.py gives them (the longest files first, by
# tests/file_seconds.json, so they start early instead of ending on one worker): XSTAGE_TEST_WORKERS=0 (or -n /
# -p no:xdist on the command line) runs in this process alone. Three workers on CI's 2 cores (2026-12-06): pytest
# 640 s instead of 784 s, but the Ray replica tests' timings (a scale-down, a queue to kill into) failed under the
# extra contention.
workers=(-n "${XSTAGE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
[ "${XSTAGE_TEST_WORKERS:-2}" = "0" ] && workers=()
for arg in "$@"; do
  case "$arg" in
    -n|-n*|--numprocesses*|no:xdist) workers=() ;;
  esac
done
# One compute thread a test process when there are several (CPU count each by default): two workers of two
# OpenMP threads each on CI's 2 cores spin against each other, and a slice of the suite ran in 39 s instead of
# 67 s with one thread each (2026-12-06). Rank processes the tests start inherit it. OMP_NUM_THREADS set by the
# caller wins.
[ ${#workers[@]} -gt 0 ] && export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python -m pytest "${verbosity[@]}" "${workers[@]}" "$@"
