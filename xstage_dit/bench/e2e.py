"""End-to-end latency on sample prompts: xstage_dit against what users run today (issue 8).

For one model and one GPU count, every prompt of ``xstage_dit/bench/prompts.txt`` runs through each
contender with the same seed, size and steps, after warm-up. Per contender it reports the end-to-end
latency (median, p90), the transformer time per denoising step (CUDA events around every transformer
forward, from forward pre/post hooks), the peak GPU memory (``torch.cuda.max_memory_allocated``, reset
per contender) and the speedup over plain diffusers on one GPU. Contenders share one loaded pipeline:
each is applied, measured and undone in turn, so a 12-14B parameter model is built once.

Drift: a GPU's clocks and temperature move over a run by more than the differences measured here. With
``--rounds N`` (N >= 2) the eager diffusers and xstage contenders are measured in N interleaved rounds (the
order rotated every round) and compared by paired ratios (same round, same prompt); with N = 1 plain diffusers
runs again after them (an A/B/A order). Each eager xstage row gets a verdict from a 95% interval of the paired
ratios: "slower" or "faster" only when the interval excludes 1, else "same within noise".

Writes ``<out-dir>/e2e-<model>-<gpus>x<gpu>.json`` (top-level ``summary``: per contender the median
latency in seconds and the speedup over plain diffusers on one GPU), ``.md`` (table) and ``.png``
(bar chart). The JSON and the table are rewritten after every contender, so a run cut short by a
time limit still leaves what it measured; SIGTERM writes the row it was measuring as "interrupted" (how long it
ran, the frames Dynamo converted) and exits 143 (`xstage_dit.bench.interrupt`).

Usage (the options are those of ``xstage-dit bench``; see ``--help``)::

    python -m xstage_dit.bench.e2e --model tiny-flux --num-prompts 1 --steps 2          # CPU smoke run
    python -m xstage_dit.bench.e2e --model full-flux --num-prompts 3 --compile          # one H200
    torchrun --nproc-per-node 4 -m xstage_dit.bench.e2e --model full-flux --gpus 4      # four GPUs
    python -m xstage_dit.bench.e2e --model full-flux --gpus 4     # the same: starts its 4 ranks itself
    python -m xstage_dit.bench.e2e --model full-nucleusmoe --steps 4 --rounds 4           # drift-robust
    python -m xstage_dit.bench.e2e --rerender benchmarks/results/e2e-full-flux-1xh200.json   # no measuring

Modules: `options` (the command line), `session` (the shared pipeline), `contenders`, `measure`, `stats`
(ratios, verdicts), `report` (JSON / Markdown / PNG), `results` (the shared result writer); this one runs them.

``benchmarks/run_e2e_gpu.sh`` runs the three models of issue 8 on a GPU machine in one budgeted call.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from xstage_dit.bench.cache_contenders import cache_entries
from xstage_dit.bench.lineup import make_contenders
from xstage_dit.bench.interrupt import Stopped, row_on_sigterm
from xstage_dit.bench.measure import measure, measure_in_rounds, precheck, prepare_pipeline, unmeasured_row
from xstage_dit.bench.options import (BASELINE, CACHE_CONTENDERS, OUR_FAMILIES, add_arguments, cache_variants,
                                      command_line, compile_also_modes, option_argv, parse_contenders, validate)
from xstage_dit.bench.report import Report, rerender, resumed_rows
from xstage_dit.bench.results import environment
from xstage_dit.bench.session import TORCH_DTYPES, Bench, bench_inputs, gpu_label, load_prompts, model_slug
from xstage_dit.comm.distributed import init_distributed
from xstage_dit.comm.launcher import launch
from xstage_dit.errors import UsageError
from xstage_dit.families import load_pipeline, model_spec
from xstage_dit.runtime.malloc_heap import keep_freed_memory


def launch_ranks(args: argparse.Namespace, gpus: int) -> int:
    """Start ``gpus`` ranks of this benchmark on this machine (as torchrun would) and wait for them."""
    if torch.cuda.is_available() and args.device != "cpu" and torch.cuda.device_count() < gpus:
        raise UsageError(f"expected --gpus <= the {torch.cuda.device_count()} visible GPU(s), got --gpus {gpus}")
    return launch(gpus, [sys.executable, "-m", "xstage_dit.bench.e2e", *option_argv(args)])


def _resolve_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UsageError("expected a CUDA GPU for --device cuda, got none")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_benchmark(args: argparse.Namespace, serve=None) -> int:
    """Run every contender on every prompt and write the results; returns the exit code.

    serve: the in-process server factory (``xstage_dit.server.inprocess.serve_pipeline``) the
    ``xstage-served`` contender needs; `xstage-dit bench` hands it in (None: that contender cannot run)."""
    t_start = time.perf_counter()
    validate(args)
    if args.rerender:
        for path in rerender(args.rerender):
            print(f"[bench] rewrote {path}", flush=True)
        return 0
    names = parse_contenders(args.contenders)
    try:
        spec = model_spec(args.model)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    gpus = args.gpus if args.gpus is not None else launched
    if launched == 1 and gpus > 1:
        return launch_ranks(args, gpus)  # every rank runs this function again, under WORLD_SIZE=gpus
    if gpus != launched:
        raise UsageError(f"expected --gpus to equal the launched ranks (WORLD_SIZE={launched}), got --gpus {gpus}")
    info = init_distributed()
    device = _resolve_device(args.device) if info.world_size == 1 else info.device
    dtype = TORCH_DTYPES["bf16" if device.type == "cuda" else "fp32"] if args.dtype == "auto" else TORCH_DTYPES[args.dtype]
    steps = args.steps or spec.steps
    height, width = args.height or spec.height, args.width or spec.width
    frames = (args.frames or spec.frames) if spec.kind == "video" else 1
    try:
        prompts = load_prompts(args.prompts, args.num_prompts)
        spec.check_size(height, width, frames, sp=gpus)  # a bad size fails here, before the model is built
    except ValueError as exc:
        raise UsageError(str(exc)) from None

    # The served rows run a server, which tells malloc to keep freed memory (runtime.malloc_heap) before its
    # warm-up; set here, before any row, every row of the run allocates alike (not the bare rows of round 1 one way
    # and the rest the other).
    malloc = keep_freed_memory() if "xstage-served" in names else None
    t0 = time.perf_counter()
    pipe = load_pipeline(args.model, dtype=dtype, device=device, seed=args.weights_seed)
    pipe.set_progress_bar_config(disable=True)
    build_s = time.perf_counter() - t0
    images, mask = bench_inputs(args, spec, width, height)
    b = Bench(args=args, spec=spec, pipe=pipe, device=device, dtype=dtype, rank=info.rank,
              world_size=info.world_size, prompts=prompts, steps=steps, height=height, width=width, frames=frames,
              t_start=t_start, build_s=build_s, images=images, mask=mask)
    try:
        b.call_kwargs(prompts[0], steps)  # validates steps, size, input images and the pipeline's arguments up front
    except ValueError as exc:
        raise UsageError(str(exc)) from None

    env = environment()  # its git commit falls back to $XSTAGE_GIT_COMMIT where the tree has no .git
    stem = Path(args.out_dir) / f"e2e-{model_slug(args.model)}-{gpus}x{gpu_label(device)}"
    compile_also = tuple(compile_also_modes(args))
    settings = {
        "model": args.model, "kind": spec.kind, "family": spec.family, "gpus": gpus, "world_size": info.world_size,
        "height": height, "width": width, "frames": frames, "steps": steps, "default_steps": spec.steps,
        "guidance": spec.guidance, "seed": args.seed, "weights_seed": args.weights_seed,
        "dtype": str(dtype).replace("torch.", ""),
        "input_images": [f"{i.width}x{i.height}" for i in images], "mask": mask is not None,
        "input_images_from": "files" if args.image else "synthetic" if images else None,
        "num_prompts": len(prompts), "prompts": prompts, "repeats": args.repeats, "warmup": args.warmup,
        "warmup_steps": min(args.warmup_steps, steps), "compile_requested": args.compile,
        "compile_also": list(compile_also),
        "time_budget_s": args.time_budget_s or None, "model_build_s": build_s, "command": command_line(args),
        "malloc_keeps_freed_memory": malloc,
        # measure_in_rounds counts the rounds every eager contender of our group completed.
        "rounds": args.rounds, "rounds_completed": 1 if args.rounds == 1 else 0,
    }
    report = Report(b, settings, env, stem)
    if args.resume:
        report.rows.extend(resumed_rows(args.resume, settings, env))
        settings["resumed_from"] = {"path": str(args.resume), "rows": [r["name"] for r in report.rows]}
    methods, every = cache_variants(args)
    expand = {name: cache_entries(name, methods, every) for name in CACHE_CONTENDERS if name in names}
    contenders = make_contenders(names, args.compile != "off", info.world_size, rounds=args.rounds, serve=serve,
                                 compile_also=compile_also, expand=expand,
                                 with_eager=not args.compiled_only)
    try:
        _measure_all(b, contenders, report, settings, args.rounds, info.rank)
    except Stopped:
        return 128 + 15  # the row it was measuring is written ("interrupted"), as a shell reports SIGTERM
    report.finish()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    base = BASELINE + "+compile" if args.compiled_only else BASELINE
    base_ok = any(r["name"] == base and r["status"] == "ok" for r in report.rows)
    return 0 if base_ok or BASELINE not in names else 1


def _measure_all(b: Bench, contenders: list, report: Report, settings: dict, rounds: int, rank: int) -> None:
    """Measure every contender into `report`: our eager group in interleaved rounds where asked, then the others in
    order, each checked first (a row that cannot run says why) and compared with the baseline's output."""
    # Only the eager group goes in rounds: a compiled variant would compile again every round (minutes on a
    # full-size model), and the other stacks cannot all be undone or must not run before ours (xfuser).
    interleaved = [c for c in contenders if c.family in OUR_FAMILIES and not c.compile] if rounds >= 2 else []
    # a baseline kept from --resume still estimates the budget; its output is gone, so nothing is compared with it
    baseline_row = report.row(BASELINE) or report.row(BASELINE + "+compile")
    reference = None
    if interleaved:
        baseline_row, reference = measure_in_rounds(b, interleaved, rounds, report)
    for contender in contenders:
        if contender in interleaved:
            continue
        kept = report.row(contender.name)
        if kept is not None and kept.get("resumed"):
            if rank == 0:
                print(f"[bench] {contender.name}: kept from --resume (median {kept['median_s']:.3f} s)", flush=True)
            continue
        status, reason = precheck(b, contender, baseline_row, report.rows)
        if status is not None:
            report.put(unmeasured_row(contender, status, reason))
            continue
        prepare_pipeline(b, contender, settings)
        if rank == 0:
            print(f"[bench] {contender.name}: running", flush=True)
        with row_on_sigterm(report, contender):
            row, output = measure(b, contender, reference)
        # the baseline's output is the reference (its compiled variant's where --compiled-only skipped it)
        if contender.name in (BASELINE, BASELINE + "+compile") and reference is None and row["status"] == "ok":
            baseline_row, reference = row, output
        report.put(row)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xstage_dit.bench.e2e", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_benchmark(args)
    except UsageError as exc:
        parser.exit(2, f"xstage_dit.bench.e2e: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
