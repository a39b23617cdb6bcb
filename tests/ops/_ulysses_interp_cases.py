"""Interpreter cases for the fused kernel, run in a subprocess with TRITON_INTERPRET=1 (set before triton
is imported, so the kernels decorate as interpreted functions whatever the parent process imported).

Prints one JSON object: case name -> {"rel_err", "nan", "shape_ok", ...}.
"""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from xstage_dit.ops.attention.kernel import KernelConfig  # noqa: E402
from xstage_dit.ops.attention import (attention_reference, fused_attention,  # noqa: E402
                                              fused_attention_virtual_ranks)

DESC = KernelConfig(32, 32, 4, 1, False, True)   # tensor-descriptor loads and TMA epilogue (the sm_90 path)
PTR = KernelConfig(32, 16, 4, 1, False, False)   # plain pointer loads and per-row epilogue (older GPUs)

# name: (batch, seq_len, heads, head_dim, virtual ranks, dtype, config)
CASES = {
    "w1_bf16_tail": (2, 77, 3, 32, 1, torch.bfloat16, DESC),
    "w1_fp16_ptr": (1, 50, 2, 16, 1, torch.float16, PTR),
    "w2_uneven_seq_and_heads": (1, 90, 5, 32, 2, torch.bfloat16, DESC),
    "w4_straddling_tiles": (2, 90, 6, 16, 4, torch.float16, DESC),
    "w4_ptr_epilogue": (1, 70, 4, 16, 4, torch.bfloat16, PTR),
    "w4_empty_last_rank": (1, 3, 4, 16, 4, torch.bfloat16, DESC),
    "w2_head_dim_64": (1, 64, 2, 64, 2, torch.bfloat16, DESC),
}


def main() -> None:
    results = {}
    for name, (batch, seq_len, heads, head_dim, world, dtype, config) in CASES.items():
        gen = torch.Generator().manual_seed(hash(name) % 2**31)
        q, k, v = (torch.randn(batch, seq_len, heads, head_dim, generator=gen).to(dtype) for _ in range(3))
        if world == 1:
            outs = [fused_attention(q, k, v, config=config)]
        else:
            outs = fused_attention_virtual_ranks(q, k, v, world_size=world, config=config)
        out = torch.cat(outs, dim=1)
        ref = attention_reference(q, k, v)
        results[name] = {
            "shape_ok": out.shape == q.shape,
            "nan": bool(torch.isnan(out).any()),
            "rel_err": ((out.float() - ref.float()).norm() / ref.float().norm()).item(),
            "lengths": [o.shape[1] for o in outs],
        }
    # A packed qkv projection sliced per tensor: non-contiguous views go in without a copy.
    qkv = torch.randn(1, 45, 3, 2, 32).to(torch.bfloat16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    out = fused_attention(q, k, v, config=DESC)
    ref = attention_reference(q, k, v)
    results["w1_packed_qkv_view"] = {"shape_ok": out.shape == q.shape, "nan": bool(torch.isnan(out).any()),
                                     "rel_err": ((out.float() - ref.float()).norm() / ref.float().norm()).item(),
                                     "lengths": [45]}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
