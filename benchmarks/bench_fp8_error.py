"""FP8's error read against bf16's own: the relative L2 of each run's final latents against an fp32 run.

For each seed, one prompt is generated with the transformer in float32 (the reference), then in bfloat16, then
with each FP8 granularity of `xstage_dit.features.fp8` (the engine's ``quantize="fp8"``; no compile, no parallel
features: the numbers are the linear layers' rounding alone). Everything else (text encoders, VAE, the scheduler's
latents between steps) stays as the pipeline builds it, so the reference differs from bf16 only inside the
transformer: the transformer's inputs are cast to its dtype and its output back to the latents' dtype.

Random weights have no outlier channels, so these numbers are a proxy for a trained model's error, not a
measurement of it: they say how far FP8 moves the result relative to how far bf16 already does, on this model.

A variant ``fp8-<granularity>+<kernel>`` adds an 8-bit attention kernel (``cudnn-fp8``, ``sage``) asked for by name
(``EngineConfig(fp8_attention=<kernel>)``, through the attention backend at world 1: ``ParallelConfig(sp=1)``).

    python benchmarks/bench_fp8_error.py --model full-flux --seeds 4 --steps 28 --variants bf16,fp8-row,fp8-tensor
    python benchmarks/bench_fp8_error.py --attention --attention-shapes flux,wan,nucleus   # kernels alone

Writes <out-dir>/fp8-error-<model>-<tag>.{json,md}; with --attention, every attention kernel's error against the
fp32 reference and its time on the served shapes (`benchmarks/_fp8_attention.py`) in
<out-dir>/fp8-attention-<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, when run as a script

from benchmarks._common import environment, write_results  # noqa: E402
from xstage_dit.engine import Engine, EngineConfig  # noqa: E402
from xstage_dit.families import load_pipeline, model_spec  # noqa: E402
from xstage_dit.features.compile import CompileConfig  # noqa: E402
from xstage_dit.features.config import ParallelConfig  # noqa: E402
from xstage_dit.features.fp8 import GRANULARITIES  # noqa: E402
from xstage_dit.runtime.generation import call_kwargs  # noqa: E402
from xstage_dit.schedule.attention_kernel import FP8_KERNELS  # noqa: E402

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


def run(args) -> tuple[list[dict], dict]:
    spec = model_spec(args.model)
    device = torch.device(args.device)
    pipe = load_pipeline(args.model, dtype=torch.bfloat16, device=device, seed=args.weights_seed)
    transformer = pipe.transformer
    hooks = casting_hooks(transformer, torch.bfloat16)
    rows = []
    try:
        for seed in range(args.seeds):
            transformer.to(torch.float32)  # bf16 -> fp32 -> bf16 is exact: the same weights after
            reference = latents(pipe, spec, seed, args)
            transformer.to(torch.bfloat16)
            for variant in args.variants:
                engine = None
                if variant != "bf16":
                    engine = Engine(engine_config(variant, device))
                    engine.apply(pipe, kind=spec.kind)
                try:
                    out = latents(pipe, spec, seed, args)
                finally:
                    if engine is not None:
                        engine.restore()
                rows.append({"variant": variant, "seed": seed, "rel_l2_vs_fp32": rel_l2(out, reference)})
                print(f"[fp8-error] seed {seed} {variant}: {rows[-1]['rel_l2_vs_fp32']:.5f}", flush=True)
    finally:
        for hook in hooks:
            hook.remove()
    summary = {}
    for variant in args.variants:
        values = [r["rel_l2_vs_fp32"] for r in rows if r["variant"] == variant]
        summary[variant] = {"mean": statistics.fmean(values), "max": max(values), "seeds": len(values)}
    bf16 = summary.get("bf16", {}).get("mean")
    for variant, stats in summary.items():
        stats["over_bf16"] = stats["mean"] / bf16 if bf16 else None
    return rows, summary


def main(argv=None) -> int:
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
    rows, summary = run(args)
    notes = ("rel_l2_vs_fp32: ||latents - latents_fp32|| / ||latents_fp32|| of the final latents, same seed and "
             "prompt; the fp32 run differs only inside the transformer. Random weights: a proxy, not a trained "
             "model's error. Command: python benchmarks/bench_fp8_error.py " + " ".join(sys.argv[1:]))
    stem = Path(args.out_dir) / f"fp8-error-{Path(args.model).name}-{args.tag}"
    table = [{"variant": v, **s} for v, s in summary.items()]
    write_results(stem, "fp8-error", rows, summary, ["variant", "mean", "max", "seeds", "over_bf16"], notes=notes,
                  env=environment(), table_rows=table)
    print(f"[fp8-error] wrote {stem}.json / .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
