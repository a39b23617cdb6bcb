"""``bench_fp8_error.py --attention``: every attention kernel on the served shapes, its error against the fp32
reference and its time, the 8-bit kernels beside the 16-bit ones in one run.

Per shape (world 1, the whole sequence on one GPU, B = 1, random N(0, 1) q, k, v in bf16; random inputs have no
outlier channels, so the errors are a proxy for a trained model's): the fp32 reference (torch SDPA in fp32); the
16-bit kernels the world-1 sweep compares ("sdpa": torch SDPA as diffusers calls it, "cudnn": torch's cuDNN backend,
"fa4" where flash-attn-4 is installed) and the 8-bit ones ("cudnn-fp8", "sage": ``ops/attention/fp8_kernels.py``,
each with its quantization and its store), as the sweep times them (``ops.attention.window_path.sweep_cases``,
``calibration.kernel_sweep.cuda_event_ms``, rounds interleaved); for cudnn-fp8 also its parts: the quantization of
q, k, v alone and cuDNN's FP8 kernel alone on quantized inputs (what fusing the quantization into the producers
could at most save). Columns: rel L2 against fp32, median ms, speed over torch SDPA and over the fastest 16-bit
kernel (> 1: faster).
"""

from __future__ import annotations

import statistics

import torch

from benchmarks._common import environment, interleaved_times, write_results
from xstage_dit.calibration.kernel_sweep import cuda_event_ms
from xstage_dit.ops.attention.fp8_reference import rel_l2
from xstage_dit.ops.attention.reference import attention_reference
from xstage_dit.schedule.attention_kernel import COMPILED_SUFFIX, FP8_KERNELS

SHAPES = {  # name -> (seq_len, heads, head_dim, where it comes from)
    "flux": (4608, 24, 128, "FLUX.1-dev 1024^2: 4096 image + 512 text tokens, 24 heads x 128"),
    "wan": (32760, 40, 128, "Wan 2.1 14B 480p x 81 frames: 32,760 tokens, 40 heads x 128 (self-attention)"),
    "nucleus": (4224, 16, 128, "NucleusMoE 1024^2: 4096 image queries over image + text keys (about 128 text "
                               "tokens; the op pads the queries to the keys), 16 heads x 128 (KV heads repeated)"),
}
SIXTEEN_BIT = ("sdpa", "cudnn", "fa4")


def _outputs(q, k, v, names):
    """{kernel: output} of each kernel on (1, S, H, D) bf16 q, k, v (the paths the world-1 op runs)."""
    import torch.nn.functional as F

    from xstage_dit.ops.attention.kernels import make_kernel
    from xstage_dit.ops.attention.window_path import cudnn_plain_attention, fa4_plain_attention, plain_kernel_attention

    runs = {"sdpa": lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                           v.transpose(1, 2)).transpose(1, 2),
            "cudnn": lambda: cudnn_plain_attention(q, k, v), "fa4": lambda: fa4_plain_attention(q, k, v)}
    runs.update({name: (lambda name=name: plain_kernel_attention(q, k, v, make_kernel(name))) for name in FP8_KERNELS})
    return {name: runs[name]() for name in names}


def _parts(q, k, v):
    """Timing closures of cudnn-fp8's two parts: the quantization alone, and cuDNN's kernel on quantized inputs."""
    from xstage_dit.ops.attention.cudnn_fp8 import CudnnFp8Attention
    from xstage_dit.ops.attention.fp8_quant import quantize_qkv

    impl, x = CudnnFp8Attention(), quantize_qkv(q, k, v)
    out = torch.empty_like(x.q)
    scale = q.shape[-1] ** -0.5
    return {"cudnn-fp8 quantize only": lambda: quantize_qkv(q, k, v),
            "cudnn-fp8 kernel only": lambda: impl.run(x, scale, out=out)}


def measure_shape(name: str, rounds: int) -> list[dict]:
    from xstage_dit.ops.attention.window_path import sweep_cases

    seq_len, heads, head_dim, origin = SHAPES[name]
    problem = dict(batch=1, seq_len=seq_len, heads=heads, head_dim=head_dim, world_size=1, dtype=torch.bfloat16,
                   device=torch.device("cuda"), fp8=True)
    ((family, fns),) = sweep_cases([problem], kernel_names=("fa4", "cudnn")).items()
    errors: dict[str, str] = {}
    if "cudnn-fp8" in fns:
        try:
            gen = torch.Generator(device="cuda").manual_seed(1)
            parts_q = [torch.randn(1, seq_len, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                       for _ in range(3)]
            fns.update(_parts(*parts_q))
        except Exception as exc:  # noqa: BLE001 - a failing part is a result of the benchmark, recorded
            errors["cudnn-fp8 parts"] = repr(exc)[:400]
    times = interleaved_times(fns, cuda_event_ms, rounds=rounds, errors=errors, required=("sdpa",))
    fns.clear()  # the sweep's tensors go before the reference's
    torch.cuda.empty_cache()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, seq_len, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    exact = attention_reference(q.float(), k.float(), v.float())
    kernels = [n for n in times if n in SIXTEEN_BIT + FP8_KERNELS]
    outputs = {}
    for kernel in kernels:
        try:
            outputs[kernel] = rel_l2(_outputs(q, k, v, [kernel])[kernel], exact)
        except Exception as exc:  # noqa: BLE001 - recorded, the others go on
            errors[kernel] = repr(exc)[:400]
    ms = {n: statistics.median(t) for n, t in times.items() if t}
    best16 = min((ms[n] for n in SIXTEEN_BIT if n in ms), default=None)
    rows = []
    for kernel, t in ms.items():
        base = kernel.split(" ")[0].removesuffix(COMPILED_SUFFIX)
        rows.append({"shape": name, "family": family, "kernel": kernel,
                     "bits": "8" if base in FP8_KERNELS else "16", "rel_l2_vs_fp32": outputs.get(kernel),
                     "median_ms": t, "rounds_ms": times[kernel], "over_sdpa": ms["sdpa"] / t,
                     "over_best_16bit": best16 / t if best16 else None, "origin": origin})
    rows += [{"shape": name, "family": family, "kernel": k, "error": e, "origin": origin} for k, e in errors.items()]
    for row in rows:
        print(f"[fp8-attention] {row}", flush=True)
    return rows


def main(args) -> int:
    from pathlib import Path

    shapes = [s for s in args.attention_shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not shapes:
        raise SystemExit(f"expected --attention-shapes from {','.join(SHAPES)}, got {args.attention_shapes!r}")
    if not torch.cuda.is_available():
        raise SystemExit("--attention times GPU kernels: expected a CUDA device, found none")
    rows = [row for shape in shapes for row in measure_shape(shape, args.rounds)]
    summary = {}
    for shape in shapes:
        mine = {r["kernel"]: r for r in rows if r["shape"] == shape and "median_ms" in r}
        summary[shape] = {k: {"rel_l2_vs_fp32": r["rel_l2_vs_fp32"], "over_best_16bit": r["over_best_16bit"]}
                          for k, r in mine.items() if r["bits"] == "8"}
    notes = ("rel_l2_vs_fp32: ||out - out_fp32|| / ||out_fp32||, random N(0, 1) q, k, v (a proxy: trained models have "
             "outlier channels). median_ms: CUDA-event time per call, rounds interleaved; over_*: speed ratios (> 1: "
             "faster). The 8-bit rows include their quantization and store; 'quantize only' / 'kernel only' split "
             "cudnn-fp8. Command: python benchmarks/bench_fp8_error.py --attention --attention-shapes "
             f"{args.attention_shapes} --rounds {args.rounds}")
    stem = Path(args.out_dir) / f"fp8-attention-{args.tag}"
    write_results(stem, "fp8-attention", rows, summary,
                  ["shape", "kernel", "bits", "rel_l2_vs_fp32", "median_ms", "over_sdpa", "over_best_16bit", "error"],
                  notes=notes, env=environment())
    print(f"[fp8-attention] wrote {stem}.json / .md")
    return 0
