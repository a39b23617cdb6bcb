"""The video VAEs' decode with one-frame causal convolutions as 2-D ones (`patches.causal_conv`) vs diffusers' 3-D.

Each row: one VAE at its served dtype (NucleusMoE / Qwen-Image's ``AutoencoderKLQwenImage`` in bfloat16, Wan's
``AutoencoderKLWan`` in float32, as the pipelines build them), random weights at full size, one latent of the
given size and frames, decoded eagerly under ``inference_mode``. Variants, timed in interleaved rounds (medians
of CUDA-event timings after warm-up): ``3d`` (diffusers' modules) and ``2d`` (the same modules patched). The
2-D path changes the summation order only: each row reports the largest and the mean absolute difference of
the decoded pixels (in [-1, 1]) against ``3d``.

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

from benchmarks._common import environment, interleaved_times, time_ms, write_results  # noqa: E402

# model -> (VAE builder module, dtype the pipeline gives its VAE, spatial compression)
VAES = {"nucleusmoe": ("xstage_dit.models.nucleusmoe", torch.bfloat16, 8), "wan": ("xstage_dit.models.wan", torch.float32, 8)}


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

    from xstage_dit.models.build import build_module

    module_name, dtype, _ = VAES[model]
    config = importlib.import_module(module_name).VAE[size]
    cls = AutoencoderKLQwenImage if model == "nucleusmoe" else AutoencoderKLWan
    return build_module(lambda: cls(**config), seed=3, device=device, dtype=dtype), dtype


def measure(case: str, args, device) -> dict:
    from xstage_dit.patches.causal_conv import one_frame_convs_as_2d

    model, height, width, frames = parse_case(case)
    vae, dtype = build_vae(model, device, args.size)
    scale = VAES[model][2]
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(1, vae.config.z_dim, frames, height // scale, width // scale, generator=gen).to(device, dtype)

    @torch.inference_mode()
    def decode():
        return vae.decode(latents, return_dict=False)[0]

    patched = {"undo": None, "count": 0}

    def run(variant):
        def fn():
            if variant == "2d" and patched["undo"] is None:
                patched["undo"], patched["count"] = one_frame_convs_as_2d(vae)
            elif variant == "3d" and patched["undo"] is not None:
                patched["undo"]()
                patched["undo"] = None
            return decode()
        return fn

    outputs = {v: run(v)().float() for v in ("3d", "2d")}
    diff = (outputs["2d"] - outputs["3d"]).abs()
    times = interleaved_times({v: run(v) for v in ("3d", "2d")},
                              lambda fn: time_ms(fn, warmup=args.warmup, reps=args.reps, device=device)["median_ms"],
                              rounds=args.rounds)
    if patched["undo"] is not None:
        patched["undo"]()
    med = {v: statistics.median(ts) for v, ts in times.items()}
    row = dict(case=case, model=model, dtype=str(dtype).replace("torch.", ""), convs_2d=patched["count"],
               ms_3d=round(med["3d"], 3), ms_2d=round(med["2d"], 3), speedup=round(med["3d"] / med["2d"], 4),
               saved_ms=round(med["3d"] - med["2d"], 3), rounds_3d=[round(t, 3) for t in times["3d"]],
               rounds_2d=[round(t, 3) for t in times["2d"]], max_abs_diff=float(diff.max()),
               mean_abs_diff=float(diff.mean()))
    print(f"{case:28s} 3d {row['ms_3d']:9.3f} ms  2d {row['ms_2d']:9.3f} ms  x{row['speedup']:.3f}  "
          f"max|diff| {row['max_abs_diff']:.3g}", flush=True)
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
    args = p.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    try:
        for case in cases:
            parse_case(case)
    except ValueError as exc:
        p.error(str(exc))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for case in cases:
        rows.append(measure(case, args, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the case's VAE is gone: the next one starts from an empty pool
    summary = {"speedup_by_case": {r["case"]: r["speedup"] for r in rows},
               "saved_ms_by_case": {r["case"]: r["saved_ms"] for r in rows}}
    columns = ["case", "dtype", "convs_2d", "ms_3d", "ms_2d", "speedup", "saved_ms", "max_abs_diff", "mean_abs_diff"]
    write_results(str(Path(args.out_dir) / f"vae-decode-{args.tag}"), "vae-decode", rows, summary, columns,
                  env=environment())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
