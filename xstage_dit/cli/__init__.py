"""The `xstage-dit` command. Each subcommand lives in its own module under `xstage_dit/cli/`
and exposes `add_parser(subparsers)` (which registers itself and sets `func`)."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order shown by --help. A module missing here is a programming error.
SUBCOMMANDS = (
    "xstage_dit.cli.generate",
    "xstage_dit.cli.calibrate",
    "xstage_dit.cli.serve",
    "xstage_dit.cli.bench",
)


class UsageError(Exception):
    """A bad option value: printed as one line `xstage-dit: error: ...` with exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xstage-dit", description="Fast multi-GPU serving of diffusers DiT pipelines.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # subcommand not written yet
                continue
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        parser.exit(2, f"xstage-dit: error: {exc}\n")
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
