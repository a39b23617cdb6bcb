#!/usr/bin/env bash
# The README's main command: sets up ./.venv on first use (scripts/env.sh), then serves the tiny FLUX
# pipeline (random weights, no download) on http://127.0.0.1:8000: web page at /, API docs at /docs. It
# prints a curl line to call it once ready; Ctrl-C stops it. Extra arguments go to `xstage-dit serve`
# (e.g. --port 9000, --sp 2, --model tiny-wan, --host 0.0.0.0).
set -e
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$root/scripts/env.sh"
cd "$root"
exec python -m xstage_dit serve --model tiny-flux "$@"
