#!/usr/bin/env python3
"""The layout section of docs/design.md, generated from the code: every package and module of `xstage_dit`
with the first sentence of its docstring, plus the top-level folders.

    python scripts/readme_layout.py --doc docs/design.md   # rewrite the block between the markers
    python scripts/readme_layout.py                        # print it

The block sits between ``<!-- layout:begin ... -->`` and ``<!-- layout:end -->``; tests/architecture checks
that it is current, so a new or renamed module shows up in docs/design.md or fails the suite.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "xstage_dit"
DOC = ROOT / "docs" / "design.md"
BEGIN = "<!-- layout:begin (generated: python scripts/readme_layout.py --doc docs/design.md) -->"
END = "<!-- layout:end -->"
TOP_LEVEL = {
    "pyproject.toml": "package, pinned dependencies, extras (gpu, bench, test), import-linter contracts",
    "scripts/": "env.sh (creates ./.venv), run.sh and test.sh (the README's two commands), gpu_tests.sh, "
                "readme_layout.py and model_table.py (the generated blocks of docs/design.md and README.md)",
    "docs/": "serving, performance (each number linked to its results file), design, development",
    "benchmarks/": "one bench_<op>.py per op, device.sh (the device runner with named steps), results/",
    "tests/": "by layer, like the package; helpers/; gpu and multigpu markers (tests/conftest.py)",
}
WIDTH = 36


def first_sentence(path: Path) -> str:
    """The docstring's first sentence (up to the first period followed by a space or the end), one line."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    match = re.match(r"(.+?\.)(\s|$)", text)
    return (match.group(1) if match else text).strip()


def entries() -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(ROOT)
        name = f"{rel.parent.as_posix()}/" if path.name == "__init__.py" else rel.as_posix()
        out.append((name, first_sentence(path)))
    return out


def render() -> str:
    lines = ["```"]
    for name, what in [*TOP_LEVEL.items(), *entries()]:
        pad = name.ljust(WIDTH) if len(name) < WIDTH else name + " "
        lines.append(f"{pad}{what}".rstrip())
    lines.append("```")
    return "\n".join(lines)


def rewrite(doc: Path) -> bool:
    """Replace the generated block in ``doc``; True when it changed. ValueError without the markers."""
    text = doc.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise ValueError(f"expected the markers {BEGIN!r} and {END!r} in {doc}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{render()}\n{END}{tail}"
    if new != text:
        doc.write_text(new, encoding="utf-8")
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc", type=Path, default=None,
                        help=f"rewrite this file's layout block (the project's: {DOC.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    if args.doc is None:
        print(render())
        return 0
    print(f"{args.doc}: {'rewritten' if rewrite(args.doc) else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
