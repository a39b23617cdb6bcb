#!/usr/bin/env bash
# The README's main command: sets up ./.venv on first use (scripts/env.sh), then generates an image with
# the tiny FLUX pipeline (random weights, no download) and prints where it went and how long it took.
# Extra arguments go to `xstage-dit generate` (e.g. --prompt "...", --seed 3, --model full-flux).
set -e
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$root/scripts/env.sh"
cd "$root"
exec python -m xstage_dit generate --model tiny-flux --output out/tiny-flux.png "$@"
