#!/usr/bin/env bash
# Source this: creates ./.venv on first use and (re)installs the project when pyproject.toml changes.
# Works on a fresh machine with only Python >= 3.11; torch comes as the CPU build 2.13.0 where no
# torch is present (a GPU machine keeps the torch it has). Each step says what it does and pip shows
# its own progress: a first install takes a few minutes and should never look stuck.
set -e
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
say() { echo "env.sh: $*" >&2; }
if [ ! -x "$root/.venv/bin/python" ]; then
  say "creating $root/.venv"
  "$py" -m venv "$root/.venv"
fi
# shellcheck disable=SC1091
. "$root/.venv/bin/activate"
stamp="$root/.venv/.xstage-installed"
want="$(cat "$root/pyproject.toml" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  pip=(python -m pip install --disable-pip-version-check --progress-bar on)
  say "installing into .venv (first run, or pyproject.toml changed); a fresh machine takes a few minutes"
  say "step 1/3: pip"
  "${pip[@]}" --upgrade pip
  if python -c "import torch" 2>/dev/null; then
    say "step 2/3: torch $(python -c 'import torch; print(torch.__version__)') already present, kept"
  else
    say "step 2/3: torch 2.13.0 (CPU build, the largest download)"
    "${pip[@]}" torch==2.13.0
  fi
  say "step 3/3: xstage_dit (editable) with its test tools"
  "${pip[@]}" -e "$root[test]"
  echo "$want" > "$stamp"
  say "done: .venv is ready"
fi
set +e
