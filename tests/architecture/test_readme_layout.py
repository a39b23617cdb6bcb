"""The README's layout section is the one scripts/readme_layout.py generates from the modules' docstrings."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("readme_layout", ROOT / "scripts" / "readme_layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_layout_is_current():
    tool = _tool()
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split(tool.BEGIN, 1)[1].split(tool.END, 1)[0].strip()
    assert block == tool.render(), "README layout is stale: run python scripts/readme_layout.py --readme README.md"


def test_every_module_is_listed_with_a_docstring():
    tool = _tool()
    missing = [name for name, what in tool.entries() if not what]
    assert not missing, f"modules without a docstring: {missing}"
