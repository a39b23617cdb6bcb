#!/usr/bin/env bash
# Installs everything into ./.venv (first run only) and runs the test suite on the CPU.
# GPU tests are skipped, and counted, without a GPU.
set -e
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/env.sh"
cd "$root"
exec python -m pytest -q "$@"
