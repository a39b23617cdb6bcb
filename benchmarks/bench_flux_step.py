"""One FLUX transformer denoising step (plain diffusers, eager): tiny and full (FLUX.1-dev) sizes.

This is the single-GPU baseline that the parallel paths are measured against: one forward of
`FluxTransformer2DModel` on the inputs `FluxPipeline` makes for one step (packed latents, T5 and CLIP
embeddings of the right shapes, image/text position ids, timestep, guidance). Text encoders are not needed,
so prompt embeddings are random. The full-size transformer is built directly on the GPU in bf16.

    python benchmarks/bench_flux_step.py                       # tiny + full at 1024^2, bf16, on cuda
    python benchmarks/bench_flux_step.py --sizes tiny --device cpu --dtype float32 --height 64 --width 64

Writes <out>.json and <out>.md (default benchmarks/results/flux-step-<gpu>).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, when run as a script

from benchmarks._common import environment, time_ms, write_results  # noqa: E402
from xstage_dit.families.flux import build_transformer  # noqa: E402
from xstage_dit.families.flux_inputs import transformer_inputs  # noqa: E402

COLUMNS = ("model", "variant", "resolution", "image_tokens", "text_tokens", "dtype", "median_ms", "p20_ms",
           "p80_ms", "reps", "params_million", "peak_mem_gib", "build_s")


def _gpu_slug() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    for known in ("h200", "h100", "b200", "a100", "l40s"):
        if known in name:
            return known
    return name.replace(" ", "-")


def measure(size: str, *, height: int, width: int, text_tokens: int, dtype: torch.dtype, device: torch.device,
            warmup: int, reps: int, seed: int = 0) -> dict:
    """Build the transformer, check one step's output, time ``reps`` steps. Returns one result row."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    model = build_transformer(size, dtype=dtype, device=device, seed=seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    build_s = time.perf_counter() - t0
    inputs = transformer_inputs(model.config, height=height, width=width, text_tokens=text_tokens, dtype=dtype,
                                device=device, seed=seed)

    @torch.inference_mode()
    def step():
        return model(**inputs, return_dict=False)[0]

    out = step()
    expected = inputs["hidden_states"].shape
    if out.shape != expected or not torch.isfinite(out).all() or out.float().abs().max() == 0:
        raise RuntimeError(f"expected a finite, non-zero output of shape {tuple(expected)}, got {tuple(out.shape)}")
    stats = time_ms(step, warmup=warmup, reps=reps, device=device)
    row = dict(
        model=f"{size}-flux",
        variant="diffusers eager (baseline)",
        resolution=f"{width}x{height}",
        image_tokens=inputs["hidden_states"].shape[1],
        text_tokens=text_tokens,
        dtype=str(dtype).removeprefix("torch."),
        **stats,
        params_million=round(sum(p.numel() for p in model.parameters()) / 1e6, 3),
        peak_mem_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        build_s=round(build_s, 2),
    )
    del model, inputs, out
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny,full", help="comma-separated: tiny, full")
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--text-tokens", type=int, default=512, help="T5 tokens (FLUX.1-dev: 512)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None, help="output stem (default benchmarks/results/flux-step-<gpu>)")
    args = p.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in ("tiny", "full")]
    if bad or not sizes:
        p.error(f"--sizes: expected tiny and/or full, got {args.sizes!r}")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    env = environment()
    rows = []
    for size in sizes:
        row = measure(size, height=args.height, width=args.width, text_tokens=args.text_tokens, dtype=dtype,
                      device=device, warmup=args.warmup, reps=args.reps)
        print(f"{row['model']:10s} {row['resolution']:>10s} {row['dtype']:9s} median {row['median_ms']:.3f} ms "
              f"(p20 {row['p20_ms']:.3f}, p80 {row['p80_ms']:.3f}, {row['reps']} reps)", flush=True)
        rows.append(row)
    summary = {
        "what": "one FLUX transformer denoising step, plain diffusers eager (the single-GPU baseline)",
        "resolution": f"{args.width}x{args.height}",
        "image_tokens": rows[0]["image_tokens"],
        "text_tokens": args.text_tokens,
        "dtype": args.dtype,
        "device": env.get("gpu") or "cpu",
    }
    for row in rows:
        summary[f"{row['model'].replace('-', '_')}_step_ms"] = row["median_ms"]
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / f"flux-step-{_gpu_slug()}"
    clock = "CUDA-event" if device.type == "cuda" else "perf_counter (CPU)"
    notes = (f"Median of per-step {clock} timings after {args.warmup} warm-up steps; random weights and random "
             "prompt embeddings (timing does not depend on values). Output checked finite and non-zero first.")
    json_path, md_path = write_results(out, "flux-step", rows, summary, COLUMNS, notes=notes, env=env)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
