"""The README's Python quick start, run as a user would: the block saved as a script, run in one process and
as two ranks started by the project's launcher (what torchrun does), on the CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
MARK = "<!-- quickstart: tests/docs/test_readme_quickstart.py runs this block"


def quickstart() -> str:
    """The fenced ``python`` block right after the quick-start marker of README.md."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert MARK in text, f"expected the marker {MARK!r} in README.md"
    match = re.match(r"[^\n]*-->\n```python\n(.*?)\n```", text.split(MARK, 1)[1], re.DOTALL)
    assert match, "expected a ```python block right after the quick-start marker"
    return match.group(1) + "\n"


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}


def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        assert image.size == (128, 128), image.size
        return np.asarray(image.convert("RGB"), dtype=np.int16)


def test_the_quick_start_is_a_few_lines_of_the_public_api():
    code = quickstart()
    assert "xstage_dit.parallelize(pipe, xstage_dit.ParallelConfig(sp=" in code
    assert "handle.restore()" in code and len(code.splitlines()) <= 20


@pytest.mark.slow
def test_the_quick_start_runs_in_one_process_and_on_two_ranks(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    for folder in (one, two):
        folder.mkdir()
        (folder / "fox.py").write_text(quickstart(), encoding="utf-8")
    done = subprocess.run([sys.executable, "fox.py"], cwd=one, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    launch = ("import sys; from xstage_dit.comm.launcher import launch; "
              "sys.exit(launch(2, [sys.executable, 'fox.py'], timeout_s=240))")
    done = subprocess.run([sys.executable, "-c", launch], cwd=two, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # Two ranks split the sequence: the same image up to float32 rounding, written once (by the output rank).
    assert sorted(p.name for p in two.iterdir()) == ["fox.png", "fox.py"]
    diff = np.abs(_pixels(one / "fox.png") - _pixels(two / "fox.png"))
    assert diff.max() <= 1, f"expected the two-rank image within one level of the one-process image, got {diff.max()}"
