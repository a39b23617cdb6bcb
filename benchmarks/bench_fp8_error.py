"""FP8's error read against bf16's own: the relative L2 of each run's final latents against an fp32 run.

For each seed, one prompt is generated with the transformer in float32 (the reference), then in bfloat16, then
with each FP8 granularity of `xstage_dit.features.fp8` (the engine's ``quantize="fp8"``; no compile, no parallel
features: the numbers are the linear layers' rounding alone). Everything else (text encoders, VAE, the scheduler's
latents between steps) stays as the pipeline builds it, so the reference differs from bf16 only inside the
transformer: the transformer's inputs are cast to its dtype and its output back to the latents' dtype.

The reference is ``--reference blockwise`` by default: the transformer outside its repeated blocks in float32, and
each block converted to float32 just before its forward and back just after (`float32_transformer`), the same
arithmetic as the whole transformer in float32 (``--reference whole``) at the memory of the bf16 model plus one
fp32 block: NucleusMoE's 17B transformer does not fit an 80 GB GPU in float32.

Random weights have no outlier channels, so these numbers are a proxy for a trained model's error, not a
measurement of it: they say how far FP8 moves the result relative to how far bf16 already does, on this model.

A variant ``fp8-<granularity>+<kernel>`` adds an 8-bit attention kernel (``cudnn-fp8``, ``sage``) asked for by name
(``EngineConfig(fp8_attention=<kernel>)``, through the attention backend at world 1: ``ParallelConfig(sp=1)``).

    python benchmarks/bench_fp8_error.py --model full-flux --seeds 4 --steps 28 --variants bf16,fp8-row,fp8-tensor
    python benchmarks/bench_fp8_error.py --model full-wan --frames 21 --seeds 4 --steps 2 --time-budget-s 500
    python benchmarks/bench_fp8_error.py --attention --attention-shapes flux,wan,nucleus   # kernels alone
    python benchmarks/bench_fp8_error.py probe-rows --out-dir DIR   # which shapes row-wise FP8 GEMMs refuse

Writes <out-dir>/fp8-error-<model>-<tag>.{json,md} after every seed (a run killed mid-way keeps the seeds it
finished; the summary says how many of those asked for, and why a run stopped early); with --time-budget-s, a seed
is not started when the previous one's wall time exceeds the budget left. With --attention, every attention
kernel's error against the fp32 reference and its time on the served shapes (`benchmarks/_fp8_attention.py`) in
<out-dir>/fp8-attention-<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, when run as a script

from benchmarks._common import environment, write_results  # noqa: E402
from benchmarks._fp8_routing import agreement, recorded_picks  # noqa: E402
from xstage_dit.engine import Engine, EngineConfig  # noqa: E402
from xstage_dit.families import load_pipeline, model_spec  # noqa: E402
from xstage_dit.features.compile import CompileConfig  # noqa: E402
from xstage_dit.features.config import ParallelConfig  # noqa: E402
from xstage_dit.features.fp8 import GRANULARITIES  # noqa: E402
from xstage_dit.runtime.generation import call_kwargs  # noqa: E402
from xstage_dit.schedule.attention_kernel import FP8_KERNELS  # noqa: E402

REFERENCES = ("whole", "blockwise")
VARIANTS = (("bf16",) + tuple(f"fp8-{g}" for g in GRANULARITIES)
            + tuple(f"fp8-{g}+{k}" for g in GRANULARITIES if g != "weight" for k in FP8_KERNELS))


def engine_config(variant: str, device) -> EngineConfig:
    """The engine of an FP8 variant: ``fp8-<granularity>`` (linear layers only, no parallel features) or
    ``fp8-<granularity>+<kernel>`` (and that 8-bit attention kernel, through the attention backend at world 1)."""
    granularity, _, kernel = variant.removeprefix("fp8-").partition("+")
    parallel = ParallelConfig(sp=1, calibrate=False) if kernel else None
    return EngineConfig(device=device, dtype=torch.bfloat16, parallel=parallel, compile=CompileConfig("off"),
                        quantize="fp8", fp8_granularity=granularity, fp8_attention=kernel or "off")


def _cast_floats(value, dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


def casting_hooks(transformer: torch.nn.Module, outer: torch.dtype) -> list:
    """Hooks that hand the transformer its inputs in its own dtype and give its output back in `outer`."""

    def before(module, args, kwargs):
        inner = next(module.parameters()).dtype
        return _cast_floats(args, inner), _cast_floats(kwargs, inner)

    def after(module, args, kwargs, output):
        return _cast_floats(output, outer)

    return [transformer.register_forward_pre_hook(before, with_kwargs=True),
            transformer.register_forward_hook(after, with_kwargs=True)]


def latents(pipe, spec, seed: int, args) -> torch.Tensor:
    kwargs = call_kwargs(pipe, spec, prompt=args.prompt, seed=seed, steps=args.steps, height=args.height,
                         width=args.width, frames=args.frames)
    with torch.inference_mode():
        out = pipe(**{**kwargs, "output_type": "latent"})
    return (out.frames if spec.kind == "video" else out.images).float().cpu()


def rel_l2(x: torch.Tensor, reference: torch.Tensor) -> float:
    return float((x - reference).norm() / reference.norm())


def repeated_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """Every child of an ``nn.ModuleList`` attribute of `transformer`, in order (FLUX's ``transformer_blocks`` and
    ``single_transformer_blocks``, Wan's ``blocks``, Lumina's refiners and ``layers``, HiDream's
    ``double_stream_blocks``). Broader than diffusers' ``_repeated_blocks`` (empty for SD3, Sana, HiDream) or its
    block-cache names (no HiDream, no refiners); a list that is not blocks (a caption projection) only costs its
    conversions."""
    return [block for child in transformer.children() if isinstance(child, torch.nn.ModuleList) for block in child]


def to_float32(modules) -> Callable[[], None]:
    """Convert the bfloat16 / float16 parameters and buffers that `modules` hold themselves (not their children's)
    to float32; returns the undo, which gives each its own dtype back (exact: the same bits). A float32 tensor
    stays (Wan's rope tables: ``transformer.to(torch.bfloat16)`` would round them)."""
    undo = []
    for module in modules:
        for param in module.parameters(recurse=False):
            if param.dtype in (torch.bfloat16, torch.float16):
                undo.append((param, None, param.dtype))
                param.data = param.data.float()
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.dtype in (torch.bfloat16, torch.float16):
                undo.append((module, name, buffer.dtype))
                setattr(module, name, buffer.float())  # stays registered, persistent or not

    def back():
        for owner, name, dtype in undo:
            if name is None:
                owner.data = owner.data.to(dtype)
            else:
                setattr(owner, name, getattr(owner, name).to(dtype))

    return back


@contextlib.contextmanager
def float32_transformer(transformer: torch.nn.Module, reference: str):
    """The transformer in float32 inside the ``with``, as it was (dtype and bits) after.

    reference: ``whole``, every parameter and buffer at once; ``blockwise``, the transformer outside its
    `repeated_blocks` at once, each block in a forward pre-hook and back in a forward hook. bf16 -> fp32 -> bf16 is
    exact, so both compute the same (tests/bench/test_bench_fp8_error.py checks the bits); blockwise peaks at the
    bf16 model plus one fp32 block (NucleusMoE's 17B transformer, 68 GB in fp32, fits no 80 GB GPU whole) and costs a
    block's weights converted twice per call.
    """
    if reference not in REFERENCES:
        raise ValueError(f"expected reference from {', '.join(REFERENCES)}, got {reference!r}")
    blocks = repeated_blocks(transformer) if reference == "blockwise" else []
    in_blocks = {id(m) for block in blocks for m in block.modules()}
    undo_rest = to_float32(m for m in transformer.modules() if id(m) not in in_blocks)
    pending: dict[torch.nn.Module, Callable[[], None]] = {}
    hooks = []
    try:
        # casting_hooks and diffusers' pipelines (``transformer.dtype``) take the inputs' dtype from the first
        # parameter (diffusers: the first outside ``_keep_in_fp32_modules``): a block's would still say bfloat16.
        dtypes = {next(transformer.parameters()).dtype, getattr(transformer, "dtype", None)} - {None}
        if dtypes != {torch.float32}:
            raise ValueError(f"expected the transformer's dtype to read float32 outside its blocks, got "
                             f"{sorted(map(str, dtypes))}: use --reference whole")

        def before(block, inputs):
            pending[block] = to_float32(block.modules())

        def after(block, inputs, output):
            # The pipeline runs under inference_mode: converted back there, the weights would be inference tensors.
            with torch.inference_mode(False):
                pending.pop(block)()

        for block in blocks:
            hooks += [block.register_forward_pre_hook(before), block.register_forward_hook(after)]
        yield transformer
    finally:
        for hook in hooks:
            hook.remove()
        for undo in pending.values():  # a block whose forward raised
            undo()
        undo_rest()


def summarize(rows: list[dict], args, stopped: str | None) -> dict:
    """The mean / max over seeds of each variant's error and its ratio to bf16's, and how many seeds finished."""
    variants = {}
    for variant in args.variants:
        values = [r["rel_l2_vs_fp32"] for r in rows if r["variant"] == variant]
        if values:
            variants[variant] = {"mean": statistics.fmean(values), "max": max(values), "seeds": len(values)}
            routed = [r["routing_agreement_vs_fp32"] for r in rows
                      if r["variant"] == variant and r.get("routing_agreement_vs_fp32") is not None]
            if routed:  # expert-choice MoE models: the share of expert picks the fp32 run made too
                variants[variant]["routing_agreement"] = statistics.fmean(routed)
    bf16 = variants.get("bf16", {}).get("mean")
    for stats in variants.values():
        stats["over_bf16"] = stats["mean"] / bf16 if bf16 else None
    return {"seeds_asked": args.seeds, "seeds_finished": len({r["seed"] for r in rows}), "stopped": stopped,
            "reference": args.reference, "variants": variants}


def write_table(args, rows: list[dict], stopped: str | None, env: dict) -> Path:
    """(Re)write <out-dir>/fp8-error-<model>-<tag>.{json,md} with the rows so far; returns the stem."""
    summary = summarize(rows, args, stopped)
    done = f"{summary['seeds_finished']} of {args.seeds} seeds finished" + (f"; stopped: {stopped}" if stopped else "")
    notes = (f"{done}. rel_l2_vs_fp32: ||latents - latents_fp32|| / ||latents_fp32|| of the final latents, same seed "
             f"and prompt; the fp32 run ({args.reference}) differs only inside the transformer. Random weights: a "
             f"proxy, not a trained model's error. Command: python benchmarks/bench_fp8_error.py {args.command}")
    stem = Path(args.out_dir) / f"fp8-error-{Path(args.model).name}-{args.tag}"
    table = [{"variant": v, **s} for v, s in summary["variants"].items()]
    columns = ["variant", "mean", "max", "seeds", "over_bf16"]
    if any("routing_agreement" in s for s in summary["variants"].values()):
        columns.append("routing_agreement")
        notes += (" routing_agreement: the share of the MoE layers' (expert, token) picks that the fp32 run made too, "
                  "over every layer call.")
    write_results(stem, "fp8-error", rows, summary, columns, notes=notes, env=env, table_rows=table)
    return stem


def run(args) -> tuple[list[dict], str | None]:
    """Every seed's rows, the results rewritten after each; returns the rows and why the run stopped early (None:
    every seed asked for finished)."""
    t_start = time.perf_counter()
    env = environment()
    spec = model_spec(args.model)
    device = torch.device(args.device)
    pipe = load_pipeline(args.model, dtype=torch.bfloat16, device=device, seed=args.weights_seed)
    transformer = pipe.transformer
    hooks = casting_hooks(transformer, torch.bfloat16)
    rows, stopped, seed_s = [], None, 0.0
    try:
        for seed in range(args.seeds):
            left = args.time_budget_s - (time.perf_counter() - t_start)
            if seed > 0 and args.time_budget_s and seed_s > left:
                stopped = (f"time budget: seed {seed} needs ~{seed_s:.1f} s (seed {seed - 1}'s), "
                           f"{max(left, 0):.1f} s left")
                print(f"[fp8-error] no more seeds: {stopped}", flush=True)
                break
            t_seed = time.perf_counter()
            with float32_transformer(transformer, args.reference), recorded_picks(transformer) as picks_fp32:
                reference = latents(pipe, spec, seed, args)
            for variant in args.variants:
                engine = None
                if variant != "bf16":
                    engine = Engine(engine_config(variant, device))
                    engine.apply(pipe, kind=spec.kind)
                try:
                    with recorded_picks(transformer) as picks:
                        out = latents(pipe, spec, seed, args)
                finally:
                    if engine is not None:
                        engine.restore()
                rows.append({"variant": variant, "seed": seed, "rel_l2_vs_fp32": rel_l2(out, reference),
                             "routing_agreement_vs_fp32": agreement(picks, picks_fp32)})
                routed = rows[-1]["routing_agreement_vs_fp32"]
                print(f"[fp8-error] seed {seed} {variant}: {rows[-1]['rel_l2_vs_fp32']:.5f}"
                      + (f" (expert picks as fp32's: {routed:.4f})" if routed is not None else ""), flush=True)
            seed_s = time.perf_counter() - t_seed
            unfinished = f"not finished: written after seed {seed} (a run killed or failed here leaves this)"
            stem = write_table(args, rows, unfinished if seed + 1 < args.seeds else None, env)
    finally:
        for hook in hooks:
            hook.remove()
    if stopped:
        stem = write_table(args, rows, stopped, env)
    print(f"[fp8-error] wrote {stem}.json / .md ({len({r['seed'] for r in rows})} of {args.seeds} seeds)")
    return rows, stopped


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["probe-rows"]:  # `benchmarks/_fp8_rows_probe.py`
        from benchmarks._fp8_rows_probe import main as probe_rows

        return probe_rows(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-flux")
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--prompt", default="a red fox in the snow, photograph")
    p.add_argument("--weights-seed", type=int, default=0)
    p.add_argument("--variants", default="bf16,fp8-row,fp8-tensor",
                   help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out-dir", default="benchmarks/results/fp8")
    p.add_argument("--tag", default="1xh100")
    p.add_argument("--reference", choices=REFERENCES, default="blockwise",
                   help="the fp32 run: the whole transformer in float32, or one repeated block at a time (the same "
                        "bits, the memory of the bf16 model plus one fp32 block)")
    p.add_argument("--time-budget-s", type=float, default=0.0,
                   help="wall-clock budget of the whole run, model build included: a seed is not started when the "
                        "previous one's wall time exceeds the budget left (default: 0 = none)")
    p.add_argument("--attention", action="store_true",
                   help="instead: every attention kernel (16- and 8-bit) on --attention-shapes, error vs fp32 and time")
    p.add_argument("--attention-shapes", default="flux,wan,nucleus", help="with --attention: flux, wan, nucleus")
    p.add_argument("--rounds", type=int, default=3, help="with --attention: interleaved timing rounds")
    args = p.parse_args(argv)
    if args.attention:
        from benchmarks._fp8_attention import main as attention_main

        return attention_main(args)
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants or args.seeds < 1:
        p.error(f"expected --variants from {','.join(VARIANTS)} and --seeds >= 1, got {bad or args.variants} "
                f"and {args.seeds}")
    if not args.time_budget_s >= 0:
        p.error(f"expected --time-budget-s >= 0 (0 = none), got {args.time_budget_s}")
    args.command = " ".join(sys.argv[1:] if argv is None else argv)
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
