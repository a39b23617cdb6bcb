"""Per-request LoRA on the GPU (issue 40): what an adapter costs a request, unfused and fused, what switching costs,
and whether anything recompiles.

FLUX.1-dev (random weights) at 1024^2, 28 steps, compiled (regional by default), with two random rank-64 adapters
on every attention and MLP projection of every block (diffusers/PEFT files under a temporary --lora-dir), served
by the engine the server runs (`xstage_dit.engine.Engine`), once per LoRA mode of --modes on the same loaded
pipeline (each build compiled and warmed up as the server's: no LoRA, then, where hot-swap slots may run, the LoRA
graphs at scale 0):

    python benchmarks/bench_serving.py lora --model full-flux --modes unfused,fused --out-dir benchmarks/results/lora

Rows, each the median of --requests pipeline calls (activation included, CUDA-synchronised), per mode:

- ``no-lora-feature``: the same pipeline without the LoRA feature at all (a separate build; before LoRA existed);
- ``no-lora``: LoRA on, the request names no adapter (the LoRA layers off: the graph without them);
- ``fixed``: every request names adapter A (unfused: resident in its slot, activation sets nothing; fused: merged
  once, the weights stay);
- ``alternating``: requests name A, B, A, B, ... (unfused: each copies its adapter into the slot; fused: each
  writes W0 + the other adapter's delta into every targeted weight from the saved copy).

``mode`` is the mode the build was given, ``mode_in_use`` the one its LoRA requests ran in (auto decides).
Summary per mode: ``<mode>_fixed_over_no_lora`` (target <= 1.05), ``<mode>_alternating_extra_ms`` (alternating
minus fixed, target <= 50 ms), ``<mode>_recompiles_after_warm_up`` (Dynamo's converted frames during the timed
rows, target 0), ``<mode>_saved_copy_mib`` (the fused mode's copy of the targeted weights).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks._common import environment, write_results

COLUMNS = ("variant", "mode", "mode_in_use", "median_s", "mean_s", "min_s", "requests", "over_no_lora")
# every attention and MLP projection of FLUX's blocks (the norms' modulation and the embedders are left out)
TARGET_WORDS = (".attn.", ".ff.", ".ff_context.", "proj_mlp", "single_transformer_blocks.")


def _targets(transformer) -> list[tuple[str, torch.nn.Linear]]:
    """(name, Linear) of every targeted layer; a layer the LoRA feature wrapped already counts as its base layer."""
    out = []
    for name, module in transformer.named_modules():
        base = getattr(module, "base_layer", None)
        linear = base if isinstance(base, torch.nn.Linear) else module
        if ".lora_" in name or name.endswith(".base_layer") or not isinstance(linear, torch.nn.Linear):
            continue
        if any(w in name for w in TARGET_WORDS) and ".norm" not in name and "blocks." in name:
            out.append((name, linear))
    return out


def _write_adapter(transformer, path: Path, rank: int, seed: int) -> int:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, m in _targets(transformer):
        state[f"transformer.{name}.lora_A.weight"] = (torch.randn(rank, m.in_features, generator=g) * 1e-3).bfloat16()
        state[f"transformer.{name}.lora_B.weight"] = (torch.randn(m.out_features, rank, generator=g) * 1e-3).bfloat16()
    save_file(state, str(path))
    return len(state) // 2


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(engine, kwargs: dict, adapters_per_call: list, reps: int) -> list[float]:
    from xstage_dit.runtime.generation import run_pipeline

    times = []
    for i in range(reps + 1):  # the first: untimed
        _sync()
        started = time.perf_counter()
        if engine.stack.lora is not None:
            engine.activate_loras(adapters_per_call[i % len(adapters_per_call)])
        run_pipeline(engine.pipe, **kwargs)
        _sync()
        if i:
            times.append(time.perf_counter() - started)
    return times


def _engine(args, pipe, lora_dir: Path | None, mode: str | None):
    """An engine on `pipe` (None: load it): with LoRA in `mode`, or (lora_dir None) without the LoRA feature."""
    from xstage_dit.engine import Engine, EngineConfig
    from xstage_dit.features.compile import CompileConfig

    fields = dict(lora_dir=str(lora_dir), max_lora_rank=args.rank, max_loras=2, max_loras_per_request=1,
                  lora_mode=mode) if lora_dir is not None else {}
    engine = Engine(EngineConfig(model=args.model, device=args.device, compile=CompileConfig(args.compile), **fields))
    engine.apply(engine.load() if pipe is None else pipe)
    return engine


def _measure_mode(args, pipe, lora_dir: Path, mode: str, kwargs: dict) -> tuple[dict, dict]:
    """({row name: seconds per request}, summary) of one LoRA mode's build on `pipe`."""
    from xstage_dit import _torch_private as tp
    from xstage_dit.runtime.generation import run_pipeline

    engine = _engine(args, pipe, lora_dir, mode)
    try:
        started = time.perf_counter()
        run_pipeline(engine.pipe, **kwargs)  # warm-up as the server's: no LoRA, then the LoRA graphs at scale 0
        with engine.lora.warming():  # a no-op where only the graphs without LoRA run (fused, or compile off)
            run_pipeline(engine.pipe, **kwargs)
        summary = {f"{mode}_warm_up_s": time.perf_counter() - started}
        converted = tp.frames_converted()
        timed = {"no-lora": _timed(engine, kwargs, [None], args.requests),
                 "fixed": _timed(engine, kwargs, [["a"]], args.requests)}
        in_use = engine.lora.mode_in_use
        timed["alternating"] = _timed(engine, kwargs, [["a"], ["b"]], args.requests)
        summary[f"{mode}_recompiles_after_warm_up"] = tp.frames_converted() - converted
        summary[f"{mode}_mode_in_use"] = in_use
        summary[f"{mode}_saved_copy_mib"] = sum(t.nbytes for t in engine.lora.fused.saved.values()) / 2**20
    finally:
        engine.restore()
    base, fixed = statistics.median(timed["no-lora"]), statistics.median(timed["fixed"])
    summary.update({f"{mode}_fixed_over_no_lora": fixed / base,
                    f"{mode}_alternating_extra_ms": (statistics.median(timed["alternating"]) - fixed) * 1e3,
                    f"{mode}_lora_cost_per_request_ms": (fixed - base) * 1e3})
    return timed, summary


def _rows(mode: str, in_use: str | None, timed: dict) -> list[dict]:
    base = statistics.median(timed["no-lora"])
    return [dict(variant=variant, mode=mode, mode_in_use=in_use if variant in ("fixed", "alternating") else None,
                 median_s=statistics.median(times), mean_s=statistics.mean(times), min_s=min(times),
                 requests=len(times), over_no_lora=statistics.median(times) / base)
            for variant, times in timed.items()]


def main(argv=None) -> int:
    from xstage_dit.features.lora.config import MODES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="full-flux")
    p.add_argument("--size", default="1024x1024")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--compile", default="regional")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--modes", default="unfused,fused",
                   help=f"comma-separated LoRA modes to measure, each a build of its own ({', '.join(MODES)})")
    p.add_argument("--no-baseline", action="store_true", help="skip the build without LoRA (its compile time)")
    p.add_argument("--out-dir", default="benchmarks/results/lora")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (tiny models), no numbers")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        p.error(f"--modes: expected distinct modes of {', '.join(MODES)}, got {args.modes!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    from xstage_dit.families import model_spec
    from xstage_dit.runtime.generation import call_kwargs, run_pipeline

    width, _, height = args.size.partition("x")
    spec = model_spec(args.model)
    summary = {"model": args.model, "size": args.size, "steps": args.steps, "rank": args.rank,
               "compile": args.compile, "modes": modes}
    lora_dir = Path(tempfile.mkdtemp(prefix="xstage-lora-bench-"))
    plain = _engine(args, None, None, None)  # loads the pipeline every build below shares
    pipe = plain.pipe
    summary["targeted_layers"] = _write_adapter(pipe.transformer, lora_dir / "a.safetensors", args.rank, 1)
    _write_adapter(pipe.transformer, lora_dir / "b.safetensors", args.rank, 2)
    kwargs = {**call_kwargs(pipe, spec, prompt="a red fox in the snow", seed=0, steps=args.steps,
                            height=int(height), width=int(width)), "output_type": "pt"}
    rows = []
    if not args.no_baseline:
        run_pipeline(pipe, **kwargs)
        times = _timed(plain, kwargs, [None], args.requests)
        rows.append(dict(variant="no-lora-feature", mode=None, median_s=statistics.median(times),
                         mean_s=statistics.mean(times), min_s=min(times), requests=len(times)))
    plain.restore()
    for mode in modes:
        timed, measured = _measure_mode(args, pipe, lora_dir, mode, kwargs)
        summary.update(measured)
        rows += _rows(mode, measured[f"{mode}_mode_in_use"], timed)
    if not args.no_baseline:  # against the first mode's no-lora row
        rows[0]["over_no_lora"] = rows[0]["median_s"] / rows[1]["median_s"]
    env = environment()
    device = (env.get('gpu') or args.device).replace(' ', '_').lower()
    stem = Path(args.out_dir) / f"lora-{args.model}-{'-'.join(modes)}-{device}"  # runs of other modes kept apart
    write_results(stem, "serving-lora", rows, summary, COLUMNS, notes=__doc__.split("\n\n", 1)[1], env=env)
    print(summary)
    return 0 if all(summary[f"{m}_recompiles_after_warm_up"] == 0 for m in modes) else 1
