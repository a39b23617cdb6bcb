"""docs/performance.md quotes only what a results file says: every line with a measured number links a file
under benchmarks/results/, and every decimal number on it is one that a linked file holds (to the digits quoted).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "performance.md"
LINK = re.compile(r"\]\(([^)#\s]+)\)")
# a decimal number, not part of a version (2.11.0), a commit or a name
NUMBER = re.compile(r"(?<![\w.])(\d+\.\d+)(?![\w.]*\d)")


def _numbers(text: str) -> list[str]:
    return [m.group(1) for m in NUMBER.finditer(text)]


def _holds(values: set[float], quoted: str) -> bool:
    digits = len(quoted.split(".")[1])
    want = float(quoted)
    return any(abs(round(v, digits) - want) < 0.5 * 10 ** -digits for v in values)


def unsupported(lines: list[str], base: Path) -> list[str]:
    """'line: number' for every decimal number no results file linked on its line holds (a table row or a
    bullet's lines count as one line)."""
    out = []
    for line in lines:
        quoted = _numbers(LINK.sub("]", line))
        if not quoted:
            continue
        files = [(base / link).resolve() for link in LINK.findall(line)]
        results = [f for f in files if f.is_relative_to(ROOT / "benchmarks" / "results")]
        if not results:
            out.append(f"{line[:80]!r}: numbers {quoted} with no results file linked")
            continue
        values = {float(n) for f in results if f.is_file() for n in re.findall(r"\d+\.\d+", f.read_text())}
        out += [f"{line[:60]!r}: {n}" for n in quoted if not _holds(values, n)]
    return out


def _entries(text: str) -> list[str]:
    """Table rows and bullets (with their continuation lines) of a Markdown text."""
    entries: list[str] = []
    for line in text.splitlines():
        if line.startswith(("|", "- ")) or not entries or not line.startswith("  "):
            entries.append(line)
        else:
            entries[-1] += " " + line.strip()
    return [e for e in entries if e.startswith(("|", "- ")) and not e.startswith("|---")]


def test_every_number_in_performance_md_is_in_a_linked_results_file():
    bad = unsupported(_entries(DOC.read_text(encoding="utf-8")), DOC.parent)
    assert not bad, "docs/performance.md: " + "; ".join(bad)


def test_the_check_catches_a_number_no_file_holds(tmp_path):
    results = ROOT / "benchmarks" / "results" / "calibration" / "h200-cacf07f.md"
    link = f"[f]({results.as_posix()})"
    assert unsupported([f"- R = 54.1 GB/s {link}"], tmp_path) == []
    assert unsupported([f"- R = 54 GB/s, MAPE 7.98 % {link}"], tmp_path) == []  # integers are not checked
    assert len(unsupported([f"- R = 54.13 GB/s {link}"], tmp_path)) == 1  # more digits than the file has
    assert len(unsupported([f"- R = 57.3 GB/s {link}"], tmp_path)) == 1
    assert len(unsupported(["- R = 54.1 GB/s, no link"], tmp_path)) == 1
    assert _entries("- a\n  b 1.5\n| x | 2.5 |\n|---|\n") == ["- a b 1.5", "| x | 2.5 |"]
