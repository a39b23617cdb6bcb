"""The layer order of DESIGN §3 as code: the import-linter contracts of pyproject.toml hold for the tree,
and they fail when an arrow runs back up (a planted import in a copy of the package)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _lint(workdir: Path) -> subprocess.CompletedProcess:
    # lint-imports reads [tool.importlinter] from pyproject.toml in the current directory and imports the
    # root package from sys.path: run it with the copy first on the path.
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    env = {"PYTHONPATH": str(workdir), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code, "--no-cache"], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300)


def _copy_tree(tmp_path: Path) -> Path:
    work = tmp_path / "tree"
    work.mkdir()
    shutil.copy(ROOT / "pyproject.toml", work / "pyproject.toml")
    shutil.copytree(ROOT / "xstage_dit", work / "xstage_dit", ignore=shutil.ignore_patterns("__pycache__"))
    return work


def test_contracts_hold_for_the_tree(tmp_path):
    proc = _lint(_copy_tree(tmp_path))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken" in proc.stdout, proc.stdout[-2000:]


# (module that gets the planted import, the module it imports, the contract's message): the bottom layer
# importing the server, the kind of arrow the contract exists to stop; a feature reaching up to the engine, which
# sits between runtime and features.
PLANTED_BACK_ARROWS = [
    ("xstage/laws.py", "xstage_dit.server.app", "xstage_dit.xstage is not allowed to import xstage_dit.server"),
    ("features/prompt_cache.py", "xstage_dit.engine", "xstage_dit.features is not allowed to import xstage_dit.engine"),
]


@pytest.mark.parametrize("module, imported, message", PLANTED_BACK_ARROWS)
def test_a_planted_back_arrow_breaks_the_layers_contract(tmp_path, module, imported, message):
    work = _copy_tree(tmp_path)
    path = work / "xstage_dit" / module
    path.write_text(path.read_text() + f"\nimport {imported}  # noqa: E402,F401  (planted)\n")
    proc = _lint(work)
    assert proc.returncode != 0
    assert message in proc.stdout, proc.stdout[-3000:]
