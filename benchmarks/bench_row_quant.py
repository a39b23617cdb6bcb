"""Row-wise FP8 quantization of a linear layer's input, one pass (`xstage_dit.ops.fp8_rows`) against Inductor's.

Each shape is one activation of FLUX.1-dev's FP8 transformer step (1024x1024: 4096 image + 512 text tokens) that
torchao quantizes row-wise (``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``): ``MxKa+Kb`` is
``cat([a (M, Ka), b (M, Kb)])``, ``g`` after it applies the tanh-GELU to b. Candidates, timed in interleaved rounds
(medians of CUDA-event timings after warm-up; each timing is ``--inner`` back-to-back calls, replayed as one CUDA
graph unless ``--no-graphs``, so the host's dispatch does not count):

- ``ours``: the one-pass Triton kernel, through the custom op (on a CPU: its reference);
- ``ours_approx``: the same with ``approx=True`` (the GPU's tanh.approx, a reciprocal product), the FP8 feature's;
- ``inductor``: ``torch.compile`` of the pure-torch reference (default options), what the FP8 feature gets today;
- ``inductor_multi_kernel``: the same compiled with ``{"triton.multi_kernel": 1}`` (Inductor's persistent reductions
  for wide rows, chosen at run time);
- ``copy``: a copy of the concatenated input (read and write it once): the memory-speed floor of any pass.

Every row: median / p20 / p80 us a call, effective GB/s (the bytes a one-pass quantizer must move: input read, e4m3
and scales written; the copy's: read and write), the ratio to ``inductor`` and, for the quantizers, how many e4m3
bytes and scales differ from ``ours`` (Inductor keeps the GELU in fp32 where eager diffusers rounds it to bf16: its
bytes may differ there; ``ours`` itself is checked against the reference run eagerly on the same device).

    python benchmarks/bench_row_quant.py --out-dir benchmarks/results/fp8 --tag h100

Writes <out-dir>/row-quant-<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, when run as a script

from benchmarks._common import checked_list, environment, interleaved_times, time_ms, write_results  # noqa: E402
from xstage_dit.ops.fp8_rows import quantize_rows, quantize_rows_reference  # noqa: E402

# FLUX.1-dev's row-quantized activations at 1024x1024: label -> where it comes from
SHAPES = {
    "4608x3072+12288g": "single block proj_out input: cat([attn_out, gelu(proj_mlp)])",
    "4096x0+12288g": "double block ff.net[2] input: gelu(ff.net[0]), image tokens",
    "4096x3072": "double block image-stream linear input (3072 wide)",
    "4608x3072": "single block linear input (3072 wide)",
}
CANDIDATES = ("ours", "ours_approx", "inductor", "inductor_multi_kernel", "copy")
_SHAPE = re.compile(r"^(\d+)x(\d+)(?:\+(\d+))?(g?)$")


def parse_shape(text: str) -> tuple[int, int, int, bool]:
    """'MxKa[+Kb][g]' -> (rows, Ka, Kb, gelu_b); without '+Kb' the row is one part (a) and takes no GELU."""
    m = _SHAPE.match(text.strip())
    if not m or (m.group(4) and not m.group(3)):
        raise ValueError(f"expected a shape 'MxKa+Kb' with an optional 'g' (GELU on b), or 'MxK', got {text!r}")
    rows, ka, kb = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
    if rows < 1 or ka + kb < 1:
        raise ValueError(f"expected at least one row and one column, got {text!r}")
    return rows, ka, kb, bool(m.group(4))


def _fresh(fn, tag: str):
    """fn with a code object of its own: Dynamo caches compiled graphs per code object, so two compiles with
    different options of one function would share (and evict) entries."""
    return types.FunctionType(fn.__code__.replace(co_name=f"{fn.__name__}_{tag}"), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


def candidates(backend: str, gelu_b: bool, x: torch.Tensor) -> dict:
    """name -> f(a, b) for the four candidates; x is cat([a, b]), the copy's source."""

    def reference(a, b):
        return quantize_rows_reference(a, b, gelu_b)

    def compiled(tag: str, options: dict | None):
        kwargs = dict(options=options) if backend == "inductor" and options else {}
        return torch.compile(_fresh(reference, tag), backend=backend, dynamic=False, **kwargs)

    dst = torch.empty_like(x)
    return {"ours": lambda a, b: quantize_rows(a, b, gelu_b),
            "ours_approx": lambda a, b: quantize_rows(a, b, gelu_b, approx=True),
            "inductor": compiled("inductor", None),
            "inductor_multi_kernel": compiled("multi_kernel", {"triton.multi_kernel": 1}),
            "copy": lambda a, b: dst.copy_(x)}


def _repeated(fn, a, b, inner: int):
    def run():
        for _ in range(inner):
            fn(a, b)
    return run


def _graphed(run):
    """run captured in a CUDA graph (the FP8 step runs under CUDA graphs): its replay times the GPU's work alone,
    not the host's dispatch of an op whose kernel can be shorter than its launch."""
    run()  # warm: Triton's and Inductor's first calls compile and autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def _differing(got, want) -> tuple[int, int]:
    (q, scale), (q_want, scale_want) = got, want
    return (int((q.view(torch.uint8) != q_want.view(torch.uint8)).sum()),
            int((scale.view(torch.int32) != scale_want.view(torch.int32)).sum()))


def measure(text: str, args, device: torch.device) -> list[dict]:
    rows, ka, kb, gelu_b = parse_shape(text)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(rows * 31 + ka * 7 + kb)
    a = torch.randn(rows, ka, device=device, generator=gen).to(dtype) if ka else None
    b = (torch.randn(rows, kb, device=device, generator=gen) * 3).to(dtype) if kb else None
    x = torch.cat([t for t in (a, b) if t is not None], dim=-1)
    fns = candidates(args.backend, gelu_b, x)
    outputs = {name: fns[name](a, b) for name in CANDIDATES}  # compiles happen here, before any timing
    reference = quantize_rows_reference(a, b, gelu_b)
    runners = {name: _repeated(fns[name], a, b, args.inner) for name in CANDIDATES}
    if device.type == "cuda" and args.graphs:
        runners = {name: _graphed(run) for name, run in runners.items()}
    name_of = {id(fn): name for name, fn in runners.items()}
    stats: dict[str, list[dict]] = {name: [] for name in CANDIDATES}

    def timed(fn) -> float:
        s = time_ms(fn, warmup=args.warmup, reps=args.reps, device=device)
        stats[name_of[id(fn)]].append(s)
        return s["median_ms"]

    interleaved_times(runners, timed, rounds=args.rounds)
    # per call, in us: the median over rounds of each round's median / p20 / p80
    per_call = {n: {k: statistics.median(s[f"{k}_ms"] for s in stats[n]) * 1e3 / args.inner
                    for k in ("median", "p20", "p80")} for n in CANDIDATES}
    med = {n: v["median"] for n, v in per_call.items()}
    width, elem = ka + kb, x.element_size()
    quant_bytes = rows * width * (elem + 1) + rows * 4
    copy_bytes = 2 * rows * width * elem
    out = []
    for name in CANDIDATES:
        moved = copy_bytes if name == "copy" else quant_bytes
        row = dict(shape=text, where=SHAPES.get(text, "custom"), dtype=args.dtype, candidate=name,
                   median_us=round(med[name], 2), p20_us=round(per_call[name]["p20"], 2),
                   p80_us=round(per_call[name]["p80"], 2), gbps=round(moved / (med[name] * 1e-6) / 1e9, 1),
                   vs_inductor=round(med["inductor"] / med[name], 3),
                   rounds_us=[round(s["median_ms"] * 1e3 / args.inner, 2) for s in stats[name]])
        if name != "copy":
            q_diff, s_diff = _differing(outputs[name], outputs["ours"] if name != "ours" else reference)
            row.update(bytes_differing=q_diff, scales_differing=s_diff,
                       compared_with="reference (eager)" if name == "ours" else "ours")
        out.append(row)
    print(f"{text:18s} " + "  ".join(f"{r['candidate']} {r['median_us']:.1f} us ({r['gbps']} GB/s)" for r in out)
          + "  differing bytes: " + ", ".join(f"{r['candidate']} {r['bytes_differing']}" for r in out
                                             if "bytes_differing" in r), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated MxKa+Kb[g] or MxK")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (tiny shapes)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the Inductor rows (tests: eager)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--inner", type=int, default=10, help="back-to-back calls in one timing")
    p.add_argument("--no-graphs", dest="graphs", action="store_false",
                   help="on CUDA, time the calls themselves, not their CUDA graph's replay")
    p.add_argument("--out-dir", default="benchmarks/results/fp8")
    p.add_argument("--tag", default="h100")
    args = p.parse_args(argv)
    shapes = checked_list(p, args.shapes, parse_shape)
    device = torch.device(args.device)
    rows = [r for shape in shapes for r in measure(shape, args, device)]
    summary = {"vs_inductor": {f"{r['shape']} {r['candidate']}": r["vs_inductor"] for r in rows},
               "ours_bytes_differing_from_reference": {r["shape"]: r["bytes_differing"] for r in rows
                                                       if r["candidate"] == "ours"}}
    columns = ["shape", "candidate", "median_us", "p20_us", "p80_us", "gbps", "vs_inductor", "bytes_differing",
               "scales_differing", "where"]
    write_results(str(Path(args.out_dir) / f"row-quant-{args.tag}"), "row-quant", rows, summary, columns,
                  env=environment(), notes=f"backend {args.backend}, {args.inner} calls a timing, device {device}, "
                  f"CUDA graphs {'on' if args.graphs and device.type == 'cuda' else 'off'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
