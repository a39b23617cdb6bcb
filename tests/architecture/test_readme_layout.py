"""The layout section of docs/design.md is the one scripts/readme_layout.py generates from the modules' docstrings."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("readme_layout", ROOT / "scripts" / "readme_layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_design_doc_layout_is_current():
    tool = _tool()
    text = tool.DOC.read_text(encoding="utf-8")
    assert tool.BEGIN in text and tool.END in text, f"expected the layout markers in {tool.DOC}"
    block = text.split(tool.BEGIN, 1)[1].split(tool.END, 1)[0].strip()
    assert block == tool.render(), "stale: run python scripts/readme_layout.py --doc docs/design.md"


def test_the_readme_has_no_layout_block():
    # the README is for a newcomer's first ten minutes; the module list lives in docs/design.md
    assert _tool().BEGIN.split(" (")[0] not in (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_module_is_listed_with_a_docstring():
    tool = _tool()
    missing = [name for name, what in tool.entries() if not what]
    assert not missing, f"modules without a docstring: {missing}"
