"""Is a bf16 ``F.linear`` row-for-row the same whether its rows run alone or in a batch of n samples? (issue 15)

The server batches image requests only where a batched image is byte-identical to the image made alone
(the server's promise, docs/serving.md; its warm-up checks it). Attention, norms and elementwise ops are per sample; the
GEMMs are where a batch of n (M = n * tokens rows) can pick another cuBLAS algorithm than one sample (split-K
or stream-K, whose partial sums may be added in bf16 where reduced-precision reductions are allowed). This
probe times and compares, for FLUX's GEMM shapes at 512^2 and 1024^2 tokens per sample, each BLAS library and
reduced-precision setting:

    python benchmarks/bench_serving.py batch-invariance --out-dir benchmarks/results/serving

Writes <out-dir>/batch-invariance-<gpu>.{json,md}: per (setting, tokens, K, N, n) whether every sample's
rows equal its one-sample call bit for bit, the max abs difference, and the GEMM's median time at M = tokens
and M = n * tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks._common import environment, time_ms, write_results

# (K, N) of FLUX.1-dev's linear layers: q/k/v/out (3072 -> 3072), MLP up (3072 -> 12288), MLP down
# (12288 -> 3072), the single block's fused proj_out (15360 -> 3072), AdaLN modulation rows are M = 1; the
# narrow ends of the transformer: x_embedder (64 -> 3072) and the final proj_out (3072 -> 64: few output tiles).
GEMMS = [(3072, 3072), (3072, 12288), (12288, 3072), (15360, 3072), (64, 3072), (3072, 64)]
TOKENS = [(1536, "512^2 (1024 image + 512 text)"), (1024, "512^2 image stream"), (4608, "1024^2"),
          (4096, "1024^2 image stream")]
COLUMNS = ("setting", "tokens", "k", "n_out", "batch", "identical", "max_abs_diff", "ms_one", "ms_batch",
           "batch_gain")


def _settings():
    out = []
    for blas in ("cublas", "cublaslt"):
        for reduced in (True, False):
            out.append((f"{blas}, bf16 reduced-precision reduction {'on' if reduced else 'off'}", blas, reduced))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="2,4")
    p.add_argument("--out-dir", default="benchmarks/results/serving")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    dev, dtype = torch.device("cuda"), torch.bfloat16
    matmul = torch.backends.cuda.matmul
    saved = (torch.backends.cuda.preferred_blas_library(), matmul.allow_bf16_reduced_precision_reduction)
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    try:
        for name, blas, reduced in _settings():
            torch.backends.cuda.preferred_blas_library(blas)
            matmul.allow_bf16_reduced_precision_reduction = reduced
            for tokens, _ in TOKENS:
                for k, n_out in GEMMS:
                    x = torch.randn((max(batches) * tokens, k), device=dev, dtype=dtype, generator=gen)
                    w = torch.randn((n_out, k), device=dev, dtype=dtype, generator=gen) * k ** -0.5
                    b = torch.randn((n_out,), device=dev, dtype=dtype, generator=gen)
                    ms_one = time_ms(lambda: F.linear(x[:tokens], w, b), warmup=2, reps=args.reps)["median_ms"]
                    for n in batches:
                        got = F.linear(x[:n * tokens], w, b)
                        # every sample of the batch against its own one-sample call, not only the first
                        diffs = [float((got[i * tokens:(i + 1) * tokens].float()
                                        - F.linear(x[i * tokens:(i + 1) * tokens], w, b).float()).abs().max())
                                 for i in range(n)]
                        ms_batch = time_ms(lambda: F.linear(x[:n * tokens], w, b), warmup=2,
                                           reps=args.reps)["median_ms"]
                        rows.append(dict(setting=name, tokens=tokens, k=k, n_out=n_out, batch=n,
                                         identical=max(diffs) == 0.0, max_abs_diff=max(diffs),
                                         ms_one=round(ms_one, 4), ms_batch=round(ms_batch, 4),
                                         batch_gain=round(n * ms_one / ms_batch, 3)))
                    print(name, tokens, k, n_out, [(r["batch"], r["identical"], r["max_abs_diff"]) for r in rows[-len(batches):]],
                          flush=True)
    finally:
        torch.backends.cuda.preferred_blas_library(saved[0])
        matmul.allow_bf16_reduced_precision_reduction = saved[1]
    summary = {}
    for name, _, _ in _settings():
        mine = [r for r in rows if r["setting"] == name]
        summary[name] = {"all_identical": all(r["identical"] for r in mine),
                         "differing": [f"{r['tokens']}x{r['k']}->{r['n_out']} n={r['batch']}" for r in mine
                                       if not r["identical"]],
                         "ms_one_total": round(sum(r["ms_one"] for r in mine if r["batch"] == batches[0]), 4)}
    gpu = torch.cuda.get_device_name().split()[-1].lower()
    out = Path(args.out_dir) / f"batch-invariance-{gpu}"
    notes = ("identical: every sample's rows of the batched F.linear (bf16, bias) equal its one-sample call bit for bit. "
             "ms: median of per-call CUDA-event timings (time_ms). batch_gain = n * ms_one / ms_batch.")
    write_results(out, "batch-invariance", rows, summary, COLUMNS, notes=notes, env=environment())
    print(summary)
    return 0

