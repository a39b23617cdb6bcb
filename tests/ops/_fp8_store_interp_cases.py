"""Interpreter cases for the 8-bit kernels' plumbing (``fp8_kernels._StoredOutputKernel.run``): a stand-in kernel
whose local output is the fp32 reference (optionally scaled by 4 and handed a descale of 1/4), stored through a fake
peer window (one flat NaN-poisoned CPU tensor, the window view as ``as_strided``) by the Triton store kernel, run in
a subprocess with TRITON_INTERPRET=1. Prints one JSON object: case -> {"rel_err", "nan", "shape_ok",
"padding_untouched"}, and "quantize_scales": the device quantizer's amaxes and scales against its torch definition
(the interpreter rounds float8 values wrongly, so only the scales and shapes are compared here; the GPU test
compares the values bit for bit).
"""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from xstage_dit.ops.attention.fp8_kernels import _StoredOutputKernel  # noqa: E402
from xstage_dit.ops.attention.kernels import OutTarget  # noqa: E402
from xstage_dit.ops.attention.reference import attention_reference  # noqa: E402
from xstage_dit.ops.attention.window import WindowGeometry  # noqa: E402

from tests.ops._window_interp_cases import window_result  # noqa: E402

CASES = {  # batch, seq_len, heads, head_dim, world, descale
    "p1_b2": (2, 40, 2, 32, 1, False),
    "p2_b2_uneven_heads": (2, 70, 5, 32, 2, False),
    "p4_b1_padding_descale": (1, 90, 4, 16, 4, True),
    "p4_empty_owner": (1, 5, 4, 16, 4, False),
    "p3_b2_descale": (2, 31, 7, 16, 3, True),
}


class ReferenceKernel(_StoredOutputKernel):
    """The reference as the 'kernel': checks which rows and keys reach ``_attend`` and where the store writes."""

    name = "reference"

    def __init__(self, descale: bool):
        self.descale = descale
        self.seen = []

    def _unavailable(self, device, head_dim):
        return None

    def _attend(self, q, k, v, scale):
        self.seen.append((q.shape[1], k.shape[1]))
        out = attention_reference(q.float(), k.float(), v.float(), scale)
        if self.descale:
            return out * 4.0, torch.full((1,), 0.25)
        return out.to(q.dtype), None


def run_case(batch, seq_len, heads, head_dim, world, descale, seed):
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16
    q, k, v = (torch.randn(batch, seq_len, heads, head_dim, generator=gen).to(dtype) for _ in range(3))
    length = -(-seq_len // world)
    geom = WindowGeometry(world, batch, seq_len, heads, head_dim, length * heads * head_dim + 64)
    flat = torch.full((geom.num_slots * geom.slot_elems,), float("nan"), dtype=dtype)
    kernel = ReferenceKernel(descale)
    assert kernel.supports(geom, dtype, q.device, True) is None
    assert "needs the peer window" in kernel.supports(geom, dtype, q.device, False)
    spec = geom.out_view(0)
    for rank in range(world):
        h0, hr = geom.heads_of(rank)
        mine = torch.zeros(3, batch, world * length, hr, head_dim, dtype=dtype)
        for t, src in enumerate((q, k, v)):
            mine[t, :, :seq_len] = src[:, :, h0:h0 + hr]
        view = flat.as_strided((spec.shape[0], spec.shape[1], hr, head_dim), spec.strides, spec.offset + h0 * head_dim)
        kernel.run(mine[0], mine[1], mine[2], OutTarget(view, torch.zeros(1, dtype=torch.int64), (0, 0, 0), h0),
                   geom, head_dim ** -0.5)
    return {**window_result(flat, geom, q, k, v), "rows_seen": sorted(set(kernel.seen)),
            "rows_expected": [world * length, seq_len]}


def quantize_scales() -> dict:
    from xstage_dit.ops.attention import fp8_quant
    from xstage_dit.ops.attention.fp8_reference import quantize_reference

    fp8_quant._check_qkv = lambda q, k, v: None  # its CUDA-device check: the interpreter runs on the CPU
    qkv = torch.randn(2, 20, 3, 4, 16, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    qkv[..., 0, :, :] *= 40.0
    q, k, v = qkv[:, :13, 0, :3], qkv[:, 3:, 1, 1:], qkv[:, 3:, 2, 1:]  # strided views, other row counts
    x = fp8_quant.quantize_qkv(q, k, v)
    descales = [float(quantize_reference(t)[1]) for t in (q, k, v)]
    return {"amax": [float(x.scales[i, 0]) for i in range(3)], "amax_expected": [float(t.abs().max()) for t in (q, k, v)],
            "descale": [float(x.scales[3 + i, 0]) for i in range(3)], "descale_expected": descales,
            "o_scales": [float(x.scales[6, 0]), float(x.scales[7, 0])],
            "o_scales_expected": [0.5 / descales[2], 2 * descales[2]],
            "shapes_ok": [tuple(t.shape) for t in (x.q, x.k, x.v)] == [(2, 13, 3, 16), (2, 17, 3, 16), (2, 17, 3, 16)]}


def main() -> None:
    results = {name: run_case(*args, seed=i) for i, (name, args) in enumerate(CASES.items())}
    results["quantize_scales"] = quantize_scales()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
