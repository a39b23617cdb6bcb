"""The layer order of DESIGN §3 as code: the import-linter contracts of pyproject.toml hold for the tree,
and they fail when an arrow runs back up (a planted import in a copy of the package)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

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


def test_a_planted_back_arrow_breaks_the_layers_contract(tmp_path):
    work = _copy_tree(tmp_path)
    laws = work / "xstage_dit" / "xstage" / "laws.py"
    # The bottom layer importing the server: the kind of arrow the contract exists to stop.
    laws.write_text(laws.read_text() + "\nimport xstage_dit.server.app  # noqa: E402,F401  (planted)\n")
    proc = _lint(work)
    assert proc.returncode != 0
    assert "xstage_dit.xstage is not allowed to import xstage_dit.server" in proc.stdout, proc.stdout[-3000:]


def test_features_may_not_import_the_engine_above_them(tmp_path):
    """The engine sits between runtime and features: a feature reaching up to it breaks the contract."""
    work = _copy_tree(tmp_path)
    feature = work / "xstage_dit" / "features" / "prompt_cache.py"
    feature.write_text(feature.read_text() + "\nimport xstage_dit.engine  # noqa: E402,F401  (planted)\n")
    proc = _lint(work)
    assert proc.returncode != 0
    assert "xstage_dit.features is not allowed to import xstage_dit.engine" in proc.stdout, proc.stdout[-3000:]
