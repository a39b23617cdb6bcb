"""The video VAEs' decode of one frame as a 2-D network (`patches.one_frame_vae`), eager and compiled, vs diffusers'.

Each row: one VAE at its served dtype (NucleusMoE / Qwen-Image's ``AutoencoderKLQwenImage`` in bfloat16, Wan's
``AutoencoderKLWan`` in float32, as the pipelines build them), random weights at full size, one latent of the
given size and frames, decoded eagerly under ``inference_mode``. Variants, timed in interleaved rounds (medians
of CUDA-event timings after warm-up): ``3d`` (diffusers' modules), ``3d+cudnn_benchmark`` (the same with
``torch.backends.cudnn.benchmark`` on for its calls: cuDNN's measured pick of 3-D algorithms), ``2d`` (`patches.one_frame_vae` as
`parallelize` applies it: one-frame convolutions in 2-D, a one-frame latent decoded without the frame cache) and
``2d+compile`` (its decoder compiled, as `apply_compile` does). The 2-D path changes the summation order
only: each row reports the largest and the mean absolute difference of the decoded pixels (in [-1, 1]) against
``3d``. A latent of several frames (a video) takes the 2-D convolutions on its first frame only; its
``2d+compile`` row is the chunked decode compiled (``--compile-extra video-vae``: three graphs a size).

    python benchmarks/bench_vae_decode.py --cases nucleusmoe:1024x1024x1,wan:480x832x1,wan:480x832x5

Writes <out-dir>/vae-decode-<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, when run as a script

from benchmarks._common import checked_list, environment, interleaved_times, time_ms, write_results  # noqa: E402

# model -> (VAE builder module, dtype the pipeline gives its VAE, spatial compression)
VAES = {"nucleusmoe": ("xstage_dit.families.nucleusmoe", torch.bfloat16, 8), "wan": ("xstage_dit.families.wan", torch.float32, 8)}


def parse_case(text: str) -> tuple[str, int, int, int]:
    """'model:HxWxF' (pixels, latent frames) -> (model, height, width, frames)."""
    try:
        model, size = text.split(":")
        height, width, frames = (int(v) for v in size.split("x"))
    except ValueError:
        raise ValueError(f"expected a case 'model:HEIGHTxWIDTHxFRAMES', got {text!r}") from None
    if model not in VAES:
        raise ValueError(f"expected a model from {sorted(VAES)}, got {model!r}")
    if min(height, width, frames) < 1 or height % 8 or width % 8:
        raise ValueError(f"expected a positive size divisible by 8 and frames >= 1, got {text!r}")
    return model, height, width, frames


def build_vae(model: str, device, size: str = "full"):
    import importlib

    from diffusers import AutoencoderKLQwenImage, AutoencoderKLWan

    from xstage_dit.families.build import build_module

    module_name, dtype, _ = VAES[model]
    config = importlib.import_module(module_name).VAE[size]
    cls = AutoencoderKLQwenImage if model == "nucleusmoe" else AutoencoderKLWan
    return build_module(lambda: cls(**config), seed=3, device=device, dtype=dtype), dtype


VARIANTS = ("3d", "3d+cudnn_benchmark", "2d", "2d+compile")


def variant_vae(model: str, variant: str, device, size: str, backend: str):
    """(vae, dtype, convs patched) for one variant: ``3d`` diffusers' VAE; ``2d`` `parallelize`'s patches (one-frame
    convolutions in 2-D, a one-frame latent decoded without the frame cache); ``2d+compile`` those with the
    one-frame decoder compiled, as `apply_compile` leaves it. Each variant has its own VAE (same seed, same
    weights), so switching between them in the rounds changes nothing Dynamo guards on."""
    from xstage_dit.features.one_frame_vae import one_frame_convs_as_2d, one_frame_decode

    vae, dtype = build_vae(model, device, size)
    if variant.startswith("3d"):
        return vae, dtype, 0
    _, convs = one_frame_convs_as_2d(vae)
    one = one_frame_decode(vae)
    if variant == "2d+compile" and one is not None:
        one.compile(backend=backend, chunks=True)  # several frames: the chunked decode (--compile-extra video-vae)
    return vae, dtype, convs


def measure(case: str, args, device) -> dict:
    model, height, width, frames = parse_case(case)
    vaes = {v: variant_vae(model, v, device, args.size, args.backend) for v in VARIANTS}
    dtype, convs = vaes["3d"][1], vaes["2d"][2]
    scale = VAES[model][2]
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(1, vaes["3d"][0].config.z_dim, frames, height // scale, width // scale, generator=gen)
    latents = latents.to(device, dtype)

    def decoder(variant):
        vae = vaes[variant][0]
        benchmark = variant.endswith("cudnn_benchmark")

        @torch.inference_mode()
        def decode():
            # cudnn.benchmark: cuDNN times its algorithms once per convolution shape (the decode's chunks repeat
            # a few shapes) instead of taking its heuristic's pick; scoped to this variant's calls.
            before, torch.backends.cudnn.benchmark = torch.backends.cudnn.benchmark, benchmark
            try:
                return vae.decode(latents, return_dict=False)[0]
            finally:
                torch.backends.cudnn.benchmark = before
        return decode

    calls = {v: decoder(v) for v in VARIANTS}
    outputs = {v: calls[v]().float() for v in VARIANTS}  # the compile happens here, before any timing
    times = interleaved_times(calls, lambda fn: time_ms(fn, warmup=args.warmup, reps=args.reps, device=device)[
        "median_ms"], rounds=args.rounds)
    med = {v: statistics.median(ts) for v, ts in times.items()}
    row = dict(case=case, model=model, dtype=str(dtype).replace("torch.", ""), convs_2d=convs)
    for variant in VARIANTS:
        key = variant.replace("+", "_")
        row.update({f"ms_{key}": round(med[variant], 3), f"rounds_{key}": [round(t, 3) for t in times[variant]]})
        if variant != "3d":
            diff = (outputs[variant] - outputs["3d"]).abs()
            row.update({f"speedup_{key}": round(med["3d"] / med[variant], 4),
                        f"saved_ms_{key}": round(med["3d"] - med[variant], 3),
                        f"max_abs_diff_{key}": float(diff.max()), f"mean_abs_diff_{key}": float(diff.mean())})
    print(f"{case:28s} " + "  ".join(f"{v} {med[v]:9.3f} ms" for v in VARIANTS) +
          f"  max|diff| {row['max_abs_diff_2d']:.3g} / {row['max_abs_diff_2d_compile']:.3g}", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="nucleusmoe:1024x1024x1,wan:480x832x1,wan:480x832x5",
                   help="comma-separated model:HEIGHTxWIDTHxLATENT_FRAMES")
    p.add_argument("--size", default="full", choices=("full", "tiny"), help="VAE dimensions (tiny: CPU tests)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out-dir", default="benchmarks/results/serving")
    p.add_argument("--tag", default="h200")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of 2d+compile (tests: eager)")
    args = p.parse_args(argv)
    cases = checked_list(p, args.cases, parse_case)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for case in cases:
        rows.append(measure(case, args, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the case's VAE is gone: the next one starts from an empty pool
    summary = {f"speedup_{v}_by_case": {r["case"]: r[f"speedup_{v}"] for r in rows} for v in ("2d", "2d_compile")}
    columns = ["case", "dtype", "convs_2d", "ms_3d", "ms_3d_cudnn_benchmark", "ms_2d", "ms_2d_compile", "speedup_2d",
               "speedup_2d_compile", "max_abs_diff_2d", "max_abs_diff_2d_compile"]
    write_results(str(Path(args.out_dir) / f"vae-decode-{args.tag}"), "vae-decode", rows, summary, columns,
                  env=environment())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
