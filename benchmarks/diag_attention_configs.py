#!/usr/bin/env python3
"""GPU diagnosis of the fused attention kernel per shape x kernel configuration.

For each (shape, config): fresh random inputs, NaN-poisoned per-rank outputs, the fused kernel over
P virtual ranks, and a report of what came back: relative error against the fp32 reference and,
where rows are NaN, which ranks / rows / heads. Used to find which configurations are correct at
head_dim 64 on the H200 (a shape that left rows unwritten with the default configuration).

    python benchmarks/diag_attention_configs.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from xstage_dit.ops.attention.kernel import KernelConfig  # noqa: E402
from xstage_dit.ops.attention.op import attention_reference, fused_attention_virtual_ranks  # noqa: E402

SHAPES = [  # batch, seq_len, heads, head_dim, virtual ranks, dtype
    (1, 333, 7, 64, 4, "bf16"),
    (1, 333, 7, 64, 4, "fp16"),
    (1, 333, 8, 64, 4, "bf16"),
    (1, 336, 8, 64, 4, "bf16"),
    (1, 333, 7, 64, 1, "bf16"),
    (1, 333, 7, 64, 2, "bf16"),
    (1, 333, 7, 128, 4, "bf16"),
    (2, 1000, 5, 64, 2, "fp16"),
    (2, 1000, 5, 64, 2, "bf16"),
    (1, 4608, 24, 64, 4, "bf16"),
    (1, 1, 2, 64, 1, "bf16"),
]
CONFIGS = [
    KernelConfig(128, 128, 4, 2, True, True),
    KernelConfig(128, 64, 4, 2, True, True),
    KernelConfig(128, 128, 8, 2, True, True),
    KernelConfig(128, 128, 4, 2, False, True),
    KernelConfig(128, 64, 4, 3, False, True),
    KernelConfig(64, 64, 4, 2, False, True),
    KernelConfig(128, 64, 4, 2, False, False),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check(shape, config: KernelConfig) -> dict:
    batch, seq_len, heads, head_dim, world, dtype = shape
    q, k, v = (torch.randn(batch, seq_len, heads, head_dim, device="cuda", dtype=DTYPES[dtype]) for _ in range(3))
    t0 = time.perf_counter()
    outs = fused_attention_virtual_ranks(q, k, v, world_size=world, config=config)
    torch.cuda.synchronize()
    row = {"shape": list(shape), "config": config.label(), "s": round(time.perf_counter() - t0, 2)}
    ref = attention_reference(q, k, v).float()
    out = torch.cat(outs, dim=1).float()
    nan = torch.isnan(out)
    row["nan_elems"] = int(nan.sum())
    if row["nan_elems"]:
        per_rank = []
        start = 0
        for r, o in enumerate(outs):
            bad = torch.isnan(o.float())
            rows = bad.any(dim=(0, 2, 3)).nonzero().flatten().tolist()
            heads_bad = bad.any(dim=(0, 1, 3)).nonzero().flatten().tolist()
            cols = bad.any(dim=(0, 1, 2)).nonzero().flatten().tolist()
            per_rank.append({"rank": r, "rows": f"{len(rows)}/{o.shape[1]}",
                             "first_rows": rows[:4], "last_rows": rows[-4:], "heads": heads_bad,
                             "cols": f"{cols[:2]}..{cols[-2:]} ({len(cols)})" if cols else []})
            start += o.shape[1]
        row["nan_where"] = per_rank
        ok = ~nan
        row["rel_err_written"] = float(((out[ok] - ref[ok]).norm() / ref[ok].norm()).item()) if ok.any() else None
    else:
        row["rel_err"] = float(((out - ref).norm() / ref.norm()).item())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="diag_attention.json")
    args = ap.parse_args()
    rows = []
    for shape in SHAPES:
        for config in CONFIGS:
            torch.manual_seed(0)
            try:
                row = check(shape, config)
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile/run is a result too
                row = {"shape": list(shape), "config": config.label(), "error": f"{type(exc).__name__}: {exc}"[:400]}
                traceback.print_exc(limit=2)
                if "illegal" in str(exc).lower() or "CUDA error" in str(exc):
                    rows.append(row)
                    Path(args.out).write_text(json.dumps(rows, indent=1))
                    sys.exit(f"CUDA context lost at {row}")
            rows.append(row)
            print(json.dumps(row), flush=True)
            Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
