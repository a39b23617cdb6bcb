#!/usr/bin/env bash
# Source this: creates ./.venv on first use and (re)installs the project when pyproject.toml changes.
# Works on a fresh machine with only Python >= 3.11; torch comes as the CPU build 2.13.0 where no
# torch is present (a GPU machine keeps the torch it has).
set -e
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
if [ ! -x "$root/.venv/bin/python" ]; then
  "$py" -m venv "$root/.venv"
fi
# shellcheck disable=SC1091
. "$root/.venv/bin/activate"
stamp="$root/.venv/.xstage-installed"
want="$(cat "$root/pyproject.toml" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  python -m pip install -q --upgrade pip
  python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
  python -m pip install -q -e "$root[test]"
  echo "$want" > "$stamp"
fi
set +e
