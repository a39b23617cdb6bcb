#!/usr/bin/env python3
"""The README's model table, generated from the family records (`xstage_dit.families.table`).

    python scripts/model_table.py --readme README.md     # rewrite the block between the markers
    python scripts/model_table.py                        # print it

The block sits between ``<!-- models:begin ... -->`` and ``<!-- models:end -->``; tests/docs/test_readme.py checks
that it is current, so a new family shows up in the README or fails the suite.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, when run as a script

from xstage_dit.families.registry import records  # noqa: E402
from xstage_dit.families.table import model_table_markdown, rewrite_block  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, default=None, help="rewrite this file's model table block")
    args = parser.parse_args(argv)
    table = model_table_markdown(records().values())
    if args.readme is None:
        print(table)
    else:
        print(f"{args.readme}: {'rewritten' if rewrite_block(args.readme, table) else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
