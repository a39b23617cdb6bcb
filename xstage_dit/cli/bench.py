"""`xstage-dit bench`: end-to-end latency of a pipeline on sample prompts, per contender.

Contenders (same seed, size and steps; each after warm-up, each with and without ``torch.compile``
when ``--compile`` is given):

- ``diffusers``: the plain diffusers pipeline on one GPU (the baseline of every speedup),
- ``diffusers-cp``: diffusers' native context parallelism (Ulysses, ``enable_parallelism``),
- ``xfuser-usp``: xDiT/xfuser's USP through its pipeline wrapper (the version pinned in the ``bench`` extra),
- ``xfuser-runner``: xDiT/xfuser's model runner, what its ``xfuser`` command runs (FLUX.1-dev, Wan 2.1 T2V;
  its own attention processors and compile mode) over the same weights,
- ``xstage-serial``: ``xstage_dit.parallelize`` with the serial schedule,
- ``xstage-calibrated``: ``xstage_dit.parallelize`` with the calibrated schedules,
- ``xstage-served``: ``xstage-calibrated``'s pipeline behind the HTTP server in this process (the same
  request as a ``POST /v1/images/generations``, or ``POST /v1/videos`` for a video model).

A contender that cannot run a configuration is reported with the reason it detected; one that does
not fit the time budget is reported as skipped. The harness is ``xstage_dit.bench`` (its options in
``xstage_dit.bench.options``, so that ``xstage-dit bench`` and ``python -m xstage_dit.bench.e2e`` take
exactly the same ones); this module only registers the subcommand.

Example::

    xstage-dit bench --model tiny-flux --num-prompts 2 --steps 2
    torchrun --nproc-per-node 4 -m xstage_dit bench --model full-flux --gpus 4 --compile
"""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    from xstage_dit.bench.options import validate

    validate(args)  # before the harness imports torch and diffusers: a typo fails in milliseconds
    from xstage_dit.bench import e2e
    from xstage_dit.server.inprocess import serve_pipeline

    return int(e2e.run_benchmark(args, serve=serve_pipeline))


def add_parser(subparsers) -> argparse.ArgumentParser:
    from xstage_dit.bench.options import add_arguments

    parser = subparsers.add_parser(
        "bench",
        help="end-to-end latency on sample prompts: xstage_dit against plain diffusers, diffusers CP and xfuser",
        description=__doc__ + "\nWrites <out-dir>/e2e-<model>-<gpus>x<gpu>.{json,md,png}.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser
