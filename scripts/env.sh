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
# Every step checks its own exit status: a sourced script's `set -e` is ignored where the caller sources it
# inside an && list (`. scripts/env.sh && lint-imports`, .ci/run), and a failed pip (a full disk) must neither
# go on nor stamp the .venv as installed (the next run would skip the install and keep the broken .venv).
_xstage_install() {
  local pip=(python -m pip install --disable-pip-version-check --progress-bar on)
  say "installing into .venv (first run, or pyproject.toml changed); a fresh machine takes a few minutes"
  say "step 1/3: pip"
  "${pip[@]}" --upgrade pip || return 1
  if python -c "import torch" 2>/dev/null; then
    say "step 2/3: torch $(python -c 'import torch; print(torch.__version__)') already present, kept"
  else
    say "step 2/3: torch 2.13.0 (CPU build, the largest download)"
    "${pip[@]}" torch==2.13.0 || return 1
  fi
  say "step 3/3: xstage_dit (editable) with its test tools"
  "${pip[@]}" -e "$root[test]" || return 1
  echo "$want" > "$stamp" || return 1
  say "done: .venv is ready"
}
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  if ! _xstage_install; then
    say "error: the install into .venv failed (pip's message above); .venv is not marked installed"
    rm -f "$stamp"
    set +e
    return 1 2>/dev/null || exit 1
  fi
fi
set +e
