"""Whether a kernel's time depends on its operands' values: random against NaN and zero data, same shapes.

An H100 runs dense attention and GEMMs at its power limit, and the power a kernel draws depends on how many bits
toggle: on constant data (NaN, zeros) the clocks stay higher and the same kernel finishes sooner. A benchmark row
whose output went NaN part-way (FP8's 0/0 on a zero row: fp8/NOTES.md) is then faster for a reason no user gets,
so `bench_e2e` marks such a row, and this measures how much it is worth on the kernels of Wan 2.1 480p x 81:

- ``sdpa``: torch's ``scaled_dot_product_attention`` on (1, 40, 32760, 128) bfloat16 q = k = v;
- ``fp8_mm``: ``torch._scaled_mm`` of a (32760, 5120) e4m3 activation by Wan's (13824, 5120) FFN weight, unit
  scales, bfloat16 out.

Each row: median / p20 / p80 ms of CUDA-event timings after warm-up, and the SM clock and board power that
``nvidia-smi`` reads right after the timing (one sample: a hint, not a measurement of the run).

    python benchmarks/bench_data_power.py --out-dir benchmarks/results/fp8 --tag 1xh100

Writes <out-dir>/data-power-<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, when run as a script

from benchmarks._common import environment, time_ms, write_results  # noqa: E402
from xstage_dit import _torch_private  # noqa: E402

FILLS = {"random": None, "nan": float("nan"), "zero": 0.0}
WAN = {"tokens": 32760, "heads": 40, "head_dim": 128, "hidden": 5120, "ffn": 13824}


def filled(like: torch.Tensor, fill: float | None) -> torch.Tensor:
    """`like` itself for random data, else a tensor of its shape and dtype holding `fill` everywhere."""
    if fill is None:
        return like
    return torch.full(like.shape, fill, device=like.device, dtype=torch.float32).to(like.dtype)


def gpu_clock_and_power() -> str:
    """``nvidia-smi``'s SM clock and power draw now, e.g. ``1575 MHz, 542.78 W`` (empty where it is missing)."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def kernels(device: torch.device) -> dict:
    """name -> (random operands, the call on operands): Wan 480p x 81's attention and FFN GEMM."""
    t, h, d = WAN["tokens"], WAN["heads"], WAN["head_dim"]
    q = torch.randn(1, h, t, d, device=device, dtype=torch.bfloat16)
    a = torch.randn(t, WAN["hidden"], device=device).to(torch.float8_e4m3fn)
    w = torch.randn(WAN["ffn"], WAN["hidden"], device=device).to(torch.float8_e4m3fn)
    scale_a = torch.ones(t, 1, device=device)
    scale_w = torch.ones(1, WAN["ffn"], device=device)
    return {
        "sdpa": (q, lambda x: torch.nn.functional.scaled_dot_product_attention(x, x, x)),
        "fp8_mm": (a, lambda x: _torch_private.scaled_mm(x, w.t(), scale_a, scale_w, bias=None,
                                                                 out_dtype=torch.bfloat16, use_fast_accum=True)),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out-dir", default="benchmarks/results/fp8")
    p.add_argument("--tag", default="1xh100")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("expected a CUDA device (the effect measured is the GPU's power limit), got none")
    device = torch.device("cuda")
    rows = []
    for name, (operand, call) in kernels(device).items():
        random_ms = None
        for fill_name, fill in FILLS.items():
            x = filled(operand, fill)
            t = time_ms(lambda: call(x), warmup=args.warmup, reps=args.reps, device=device)
            random_ms = t["median_ms"] if fill is None else random_ms
            rows.append({"kernel": name, "data": fill_name, "median_ms": t["median_ms"], "p20_ms": t["p20_ms"],
                         "p80_ms": t["p80_ms"], "over_random": t["median_ms"] / random_ms,
                         "clock_power_after": gpu_clock_and_power()})
            print(f"[data-power] {name} {fill_name}: {t['median_ms']:.3f} ms ({rows[-1]['clock_power_after']})",
                  flush=True)
    notes = ("over_random: this row's median over the same kernel's on random data (below 1 = faster). "
             "clock_power_after: one nvidia-smi sample right after the timing. Command: python "
             "benchmarks/bench_data_power.py " + " ".join(sys.argv[1:]))
    stem = Path(args.out_dir) / f"data-power-{args.tag}"
    write_results(stem, "data-power", rows, {"shapes": WAN}, ["kernel", "data", "median_ms", "p20_ms", "p80_ms",
                                                               "over_random", "clock_power_after"],
                  notes=notes, env=environment())
    print(f"[data-power] wrote {stem}.json / .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
