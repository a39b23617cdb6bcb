"""Every script the results notes and the docs cite exists, or says where it went.

Scanned: README.md, docs/**/*.md and benchmarks/results/**/*.md. Checked there: every path under benchmarks/ or
scripts/ and every bare script name (``bench_*.py``, ``probe_*.py``, ``*.sh``, ...), and in README.md and
docs/ also every path under tests/ and xstage_dit/ (they describe the code as it is; the results notes describe
it at the commit they name). A script that no longer exists may stay cited when the text right after it says
so and names a commit that holds it: ``probe_x.py`` (script removed; at 2602192). Where git history is at
hand, the commit is checked to hold the file.
"""

from __future__ import annotations

import itertools
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT_DIRS = ("benchmarks", "scripts")
CODE_DIRS = ("tests", "xstage_dit")
# a path under one of the repo's folders, with optional {a,b} alternatives and * wildcards
PATH = re.compile(r"(?<![\w/.-])((?:benchmarks|scripts|tests|xstage_dit)/[\w/.{},*-]*?[\w}*]\.(?:py|sh))(?![\w/])")
# a script named without its folder
BARE = re.compile(r"(?<![\w/.*-])((?:bench|probe|diag|run|refit|regime)_\w+\.(?:py|sh)|[\w-]+\.sh)(?![\w/])")
REMOVED = re.compile(r"^[^\n]{0,12}\(script removed[^)\n]*?\b(?:at|see commit) ([0-9a-f]{7,40})\b")


def documents() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "benchmarks" / "results").rglob("*.md"))]
    return [p for p in found if p.is_file()]


def expand(path: str) -> list[str]:
    """``a/{b,c}.py`` -> [``a/b.py``, ``a/c.py``] (each brace group in turn)."""
    parts = re.split(r"\{([^{}]*)\}", path)
    fixed, choices = parts[0::2], [group.split(",") for group in parts[1::2]]
    return ["".join(itertools.chain.from_iterable(itertools.zip_longest(fixed, pick, fillvalue="")))
            for pick in itertools.product(*choices)]


def exists(path: str) -> bool:
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).is_file()


def citations(doc: Path) -> list[tuple[str, str, int]]:
    """(the path as written, the path in the repo, offset after it) of every checked citation in `doc`."""
    text = doc.read_text(encoding="utf-8")
    checks_code = not doc.is_relative_to(ROOT / "benchmarks" / "results")
    out = []
    for match in PATH.finditer(text):
        cited = match.group(1)
        if cited.startswith(SCRIPT_DIRS) or (checks_code and cited.startswith(CODE_DIRS)):
            out += [(cited, path, match.end()) for path in expand(cited)]
    for match in BARE.finditer(text):
        name = match.group(1)
        homes = [f"{d}/{name}" for d in SCRIPT_DIRS]
        out.append((name, next((h for h in homes if exists(h)), homes[0]), match.end()))
    return out


def _commit_holds(commit: str, path: str) -> bool | None:
    """Whether `commit` has `path` (None when this checkout has no git history to ask)."""
    if not (ROOT / ".git").exists():
        return None
    done = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}:{path}"], capture_output=True)
    return done.returncode == 0


def problems(doc: Path) -> list[str]:
    text = doc.read_text(encoding="utf-8")
    out = []
    for cited, path, end in citations(doc):
        if exists(path):
            continue
        removed = REMOVED.match(text[end:].lstrip("`"))
        if removed is None:
            out.append(f"{cited} (no such file, and no '(script removed; at <commit>)' after it)")
        elif _commit_holds(removed.group(1), path) is False:
            out.append(f"{cited} (commit {removed.group(1)} does not hold {path})")
    return out


@pytest.mark.parametrize("doc", documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_cited_script_exists_or_says_where_it_went(doc):
    found = problems(doc)
    assert not found, f"{doc.relative_to(ROOT)} cites: " + "; ".join(found)


def test_the_scanner_finds_what_it_must(tmp_path, monkeypatch):
    assert expand("a/{b,c}/d{e,f}.py") == ["a/b/de.py", "a/b/df.py", "a/c/de.py", "a/c/df.py"]
    doc = ROOT / "docs" / "_scanner_probe.md"  # inside docs/, so code paths are checked too
    text = ("run `benchmarks/bench_serving.py` and `device.sh`; `benchmarks/nope.py`; `xstage_dit/nope.py`; "
            "`probe_gone.py` (script removed; at 0000000); `tests/bench/test_device_runner.py`")
    monkeypatch.setattr(Path, "read_text", lambda self, encoding=None: text if self == doc else "")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1))
    found = problems(doc)
    assert [f.split(" ")[0] for f in found] == ["benchmarks/nope.py", "xstage_dit/nope.py", "probe_gone.py"]
    assert "does not hold" in found[2]  # the annotation is read, and its commit checked
