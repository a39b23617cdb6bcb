"""`xstage-dit bench`: end-to-end latency of a pipeline on sample prompts, per contender.

Contenders (same seed, size and steps; each after warm-up, each with and without ``torch.compile``
when ``--compile`` is given):

- ``diffusers``: the plain diffusers pipeline on one GPU (the baseline of every speedup),
- ``diffusers-cp``: diffusers' native context parallelism (Ulysses, ``enable_parallelism``),
- ``xfuser-usp``: xDiT/xfuser's USP (the version pinned in the ``bench`` extra),
- ``xstage-serial``: ``xstage_dit.parallelize`` with the serial schedule,
- ``xstage-calibrated``: ``xstage_dit.parallelize`` with the calibrated schedules.

A contender that cannot run a configuration is reported with the reason it detected; one that does
not fit the time budget is reported as skipped. The measurement lives in ``xstage_dit/bench/e2e.py``
of the source checkout (next to the shared benchmark helpers); this module owns the options, so that
``xstage-dit bench`` and ``python xstage_dit/bench/e2e.py`` take exactly the same ones.

Example::

    xstage-dit bench --model tiny-flux --num-prompts 2 --steps 2
    torchrun --nproc-per-node 4 -m xstage_dit bench --model full-flux --gpus 4 --compile
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Contender names in the order they run: the baseline first, the irreversible one (diffusers' native
# context parallelism has no public way to undo) after every reversible one.
CONTENDERS = ("diffusers", "xstage-serial", "xstage-calibrated", "xfuser-usp", "diffusers-cp")

REPO_ROOT = Path(__file__).resolve().parents[2]
# The sample prompts ship inside the package, so an installed wheel benchmarks too.
PROMPTS = Path(__file__).resolve().parents[1] / "bench" / "prompts.txt"

DTYPES = ("auto", "bf16", "fp16", "fp32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register every option of the end-to-end benchmark on ``parser``."""
    parser.add_argument("--model", default="tiny-flux",
                        help="built-in model name (tiny-flux, full-flux, full-wan, full-nucleusmoe, ...) or a local "
                             "diffusers folder with real weights (default: %(default)s)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPU count of the run; must equal the launched ranks (torchrun's WORLD_SIZE; default: it)")
    parser.add_argument("--prompts", default=str(PROMPTS),
                        help="file with one prompt per line ('#' comments skipped) (default: the package's bench/prompts.txt)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="measure only the first N prompts (default: all of them)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    parser.add_argument("--height", type=int, default=None, help="image/video height in pixels (default: the model's)")
    parser.add_argument("--width", type=int, default=None, help="image/video width in pixels (default: the model's)")
    parser.add_argument("--frames", type=int, default=None, help="video frames (default: the model's; images: 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and of every generation (default: 0)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="warm-up generations per contender before timing (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=1,
                        help="denoising steps of a warm-up generation: every step runs the same kernels, so one step "
                             "warms up (and compiles) everything (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure the eager diffusers and xstage contenders in N interleaved rounds (each round "
                             "applies, warms up, times every prompt and undoes each of them, in an order rotated "
                             "every round), so drift of the GPU over the run hits them all alike; the compiled "
                             "variants and the other stacks still run once. 1 = once each, with plain diffusers "
                             "repeated after the xstage contenders (default: %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="weights and activations; auto = bf16 on a GPU, fp32 on the CPU (default: auto)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where to run; auto = cuda when available (default: auto)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help=f"comma-separated subset of {','.join(CONTENDERS)} (default: all)")
    parser.add_argument("--compile", action="store_true",
                        help="also run each contender with torch.compile on the transformer (reported as skipped "
                             "otherwise)")
    parser.add_argument("--compile-mode", choices=("regional", "full"), default="regional",
                        help="regional = diffusers' compile_repeated_blocks (each repeated block compiled once; "
                             "the whole module where a model has none), full = torch.compile of the whole "
                             "transformer (default: %(default)s)")
    parser.add_argument("--time-budget-s", type=float, default=0.0,
                        help="wall-clock budget of the whole run, model build included; a contender whose estimated "
                             "cost does not fit is reported 'skipped: time budget' (default: 0 = unlimited)")
    parser.add_argument("--compile-estimate-s", type=float, default=120.0,
                        help="compile time assumed by the budget check for a torch.compile variant (default: %(default)s)")
    parser.add_argument("--out-dir", default=str(REPO_ROOT / "benchmarks" / "results"),
                        help="where e2e-<model>-<gpus>x<gpu>.{json,md,png} go (default: benchmarks/results)")
    parser.add_argument("--rerender", metavar="PATH.json", default=None,
                        help="measure nothing: recompute the comparisons, verdicts, summary and notes of a results "
                             "JSON written by this benchmark with the current code, and rewrite its .json/.md/.png "
                             "in place (the measured numbers stay as they are; the other options are ignored)")


def parse_contenders(text: str) -> list[str]:
    """The contender names of a comma-separated list, in run order; UsageError naming an unknown one."""
    from xstage_dit.cli import UsageError

    names = [n.strip() for n in str(text).split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if not names or unknown:
        raise UsageError(f"expected --contenders from {','.join(CONTENDERS)}, got {text!r}")
    return [n for n in CONTENDERS if n in names]


def validate(args: argparse.Namespace) -> None:
    """Check option values before any model is built; UsageError names the bad value."""
    from xstage_dit.cli import UsageError

    positive = {"--steps": args.steps, "--num-prompts": args.num_prompts, "--gpus": args.gpus,
                "--height": args.height, "--width": args.width, "--frames": args.frames,
                "--warmup-steps": args.warmup_steps, "--rounds": args.rounds}
    for flag, value in positive.items():
        if value is not None and value < 1:
            raise UsageError(f"expected {flag} >= 1, got {value}")
    if args.rerender is not None and not Path(args.rerender).is_file():
        raise UsageError(f"expected --rerender to be a results JSON written by xstage-dit bench, got {args.rerender!r}")
    if args.warmup < 0:
        raise UsageError(f"expected --warmup >= 0, got {args.warmup}")
    if not args.time_budget_s >= 0:
        raise UsageError(f"expected --time-budget-s >= 0 (0 = unlimited), got {args.time_budget_s}")
    if not args.compile_estimate_s >= 0:
        raise UsageError(f"expected --compile-estimate-s >= 0, got {args.compile_estimate_s}")
    if not Path(args.prompts).is_file():
        raise UsageError(f"expected --prompts to be a file of prompts, got {args.prompts!r}")
    parse_contenders(args.contenders)


def run(args: argparse.Namespace) -> int:
    validate(args)
    from xstage_dit.bench import e2e

    return int(e2e.run_benchmark(args))


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench",
        help="end-to-end latency on sample prompts: xstage_dit against plain diffusers, diffusers CP and xfuser",
        description=__doc__ + "\nWrites <out-dir>/e2e-<model>-<gpus>x<gpu>.{json,md,png}.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser
