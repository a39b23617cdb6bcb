"""README.md is a newcomer's first ten minutes (STYLE 20): under 16 KB, the two setup commands at the very top,
the model table generated from the family records, every environment variable the code reads in its one table,
and every local link of the README and docs/ resolving."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from xstage_dit.families.registry import records
from xstage_dit.families.table import BEGIN, END, model_table_markdown

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_BYTES = 16 * 1024
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _text(path: Path = README) -> str:
    return path.read_text(encoding="utf-8")


def test_the_readme_is_short():
    size = README.stat().st_size
    assert size < MAX_BYTES, f"expected README.md under {MAX_BYTES} bytes, got {size}: move details to docs/"


def test_the_two_setup_commands_come_first():
    first_block = re.match(r"# xstage_dit\n\n```bash\n(.*?)\n```\n", _text(), re.DOTALL)
    assert first_block, "expected the title, then a bash block of the setup commands"
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["./scripts/run.sh", "./scripts/test.sh"], commands
    for command in commands:
        assert (ROOT / command).is_file(), command


def test_the_model_table_is_the_one_the_family_records_give():
    text = _text()
    assert BEGIN in text and END in text, "expected the model table markers in README.md"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert block == model_table_markdown(records().values()), (
        "README's model table is stale: python scripts/model_table.py --readme README.md")


def _env_names_read() -> set[str]:
    """XSTAGE_* environment variables the package, scripts, benchmarks and tests read."""
    names = set()
    for path in [*ROOT.joinpath("xstage_dit").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py"),
                 *ROOT.joinpath("benchmarks").glob("*.py")]:
        names |= set(re.findall(r"[\"'](XSTAGE_[A-Z0-9_]+)[\"']", path.read_text(encoding="utf-8")))
    for path in [*ROOT.joinpath("scripts").glob("*.sh"), *ROOT.joinpath("benchmarks").glob("*.sh")]:
        names |= set(re.findall(r"\$\{?(XSTAGE_[A-Z0-9_]+)", path.read_text(encoding="utf-8")))
    return names


def test_every_environment_variable_read_is_in_the_readme_table():
    table = _text().split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", table))
    read = _env_names_read()
    assert {"XSTAGE_API_KEY", "XSTAGE_DIT_CACHE"} <= read  # the scan finds what it must
    assert not read - listed, f"environment variables missing from the README's table: {sorted(read - listed)}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _docs() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_local_link_resolves(doc):
    bad = []
    for link in LINK.findall(_text(doc)):
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            bad.append(link)
        elif anchor and anchor not in {_anchor(h) for h in re.findall(r"^#+ (.+)$", _text(path), re.MULTILINE)}:
            bad.append(link)
    assert not bad, f"{doc.relative_to(ROOT)}: links that lead nowhere: {bad}"
