"""The `xstage-dit` command. Each subcommand lives in its own module under `xstage_dit/cli/`
and exposes `add_parser(subparsers)` (which registers itself and sets `func`)."""

from __future__ import annotations

import argparse
import importlib
import re
import sys

from xstage_dit.errors import UsageError

# Subcommand modules, in the order shown by --help. A module missing here is a programming error.
SUBCOMMANDS = (
    "xstage_dit.cli.generate",
    "xstage_dit.cli.calibrate",
    "xstage_dit.cli.serve",
    "xstage_dit.cli.bench",
)

__all__ = ["UsageError", "build_parser", "main", "parallel_config"]

_PARALLEL_FIELD = re.compile(r"expected (sp|ep|cfg|timeout_s)\b")


def parallel_config(args: argparse.Namespace, timeout_flag: str | None = None):
    """The command's one `ParallelConfig`, from --sp/--ep/--cfg (and the timeout option `timeout_flag`,
    e.g. "--collective-timeout"); its validation error becomes a UsageError naming the option."""
    from xstage_dit.features.config import ParallelConfig, cfg_batch_of

    timeout = {} if timeout_flag is None else {"timeout_s": getattr(args, timeout_flag.lstrip("-").replace("-", "_"))}
    try:
        return ParallelConfig(sp=args.sp, ep=args.ep, cfg=args.cfg, cfg_batch=cfg_batch_of(args),
                              **timeout)
    except ValueError as exc:
        match = _PARALLEL_FIELD.search(str(exc))
        field = match.group(1) if match else "sp/--ep/--cfg"
        flag = timeout_flag if field == "timeout_s" else f"--{field}"
        raise UsageError(f"{flag}: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    from xstage_dit import __version__

    parser = argparse.ArgumentParser(prog="xstage-dit", description="Fast multi-GPU serving of diffusers DiT pipelines.")
    parser.add_argument("--version", action="version", version=f"xstage-dit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(args.func(args) or 0)
    except UsageError as exc:
        parser.exit(2, f"xstage-dit: error: {exc}\n")
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    # A rank of `generate` / `serve` / `bench` that got here ended normally: leave its process group now,
    # not to interpreter finalization (comm.distributed.close_distributed says why).
    from xstage_dit.comm.distributed import close_distributed

    close_distributed()
    return code
