"""Interpreter cases: the Triton table kernel writing through a fake peer window (one flat CPU tensor whose
slots are the owners' buffers; table entry o = slot (0, o), batch stride P slots), run in a subprocess with
TRITON_INTERPRET=1. Prints one JSON object: case -> {"rel_err", "nan", "shape_ok", "padding_untouched"}.
"""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from xstage_dit.ops.attention.kernel import KernelConfig  # noqa: E402
from xstage_dit.ops.attention.kernels import OutTarget, TritonTableKernel  # noqa: E402
from xstage_dit.ops.attention.window import WindowGeometry  # noqa: E402
from xstage_dit.ops.attention.reference import attention_reference  # noqa: E402

DESC = KernelConfig(32, 32, 4, 1, False, True)

CASES = {  # batch, seq_len, heads, head_dim, world, dtype
    "p2_b2_uneven_heads": (2, 70, 5, 32, 2, torch.bfloat16),
    "p4_b1_padding": (1, 90, 4, 16, 4, torch.float16),
    "p4_b2_h30_padding": (2, 45, 30, 16, 4, torch.bfloat16),
    "p1_b2": (2, 40, 2, 32, 1, torch.bfloat16),
}



def window_result(flat: torch.Tensor, geom: WindowGeometry, q, k, v) -> dict:
    """Read the owners' rows back out of the fake window `flat` (NaN-poisoned before the kernels ran) and compare
    them with the fp32 reference of q, k, v (B, S, H, D): "shape_ok", "nan", "rel_err", "padding_untouched" (no
    padding row or slot tail written), "padding_rows"."""
    batch, world = q.shape[0], geom.world_size
    rows = geom.owner_rows()
    outs = []
    for o in range(world):
        per_b = [flat.as_strided(geom.owner_buffer(b, o).shape, geom.owner_buffer(b, o).strides,
                                 geom.owner_buffer(b, o).offset)[:rows[o]] for b in range(batch)]
        outs.append(torch.stack(per_b))
    out = torch.cat(outs, dim=1)
    ref = attention_reference(q, k, v)
    untouched = all(bool(torch.isnan(flat.as_strided(geom.owner_buffer(b, o).shape, geom.owner_buffer(b, o).strides,
                                                     geom.owner_buffer(b, o).offset)[first:end]).all())
                    for b, o, first, end in geom.padding_rows())
    for i in range(geom.num_slots):
        start = i * geom.slot_elems + geom.buffer_elems
        untouched = untouched and bool(torch.isnan(flat[start:(i + 1) * geom.slot_elems]).all())
    return {"shape_ok": out.shape == ref.shape, "nan": bool(torch.isnan(out).any()),
            "rel_err": ((out.float() - ref.float()).norm() / ref.float().norm()).item(),
            "padding_untouched": untouched, "padding_rows": len(geom.padding_rows())}

def run_case(batch, seq_len, heads, head_dim, world, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, seq_len, heads, head_dim, generator=gen).to(dtype) for _ in range(3))
    length = -(-seq_len // world)
    elem = q.element_size()
    geom = WindowGeometry(world, batch, seq_len, heads, head_dim, length * heads * head_dim + 64)
    flat = torch.full((geom.num_slots * geom.slot_elems,), float("nan"), dtype=dtype)
    table = torch.tensor([flat.data_ptr() + geom.slot(0, o) * geom.slot_elems * elem for o in range(world)],
                         dtype=torch.int64)
    kernel = TritonTableKernel(DESC)
    assert kernel.supports(geom, dtype, q.device, False) is None
    for rank in range(world):
        h0, hr = geom.heads_of(rank)
        mine = torch.zeros(3, batch, world * length, hr, head_dim, dtype=dtype)
        for t, src in enumerate((q, k, v)):
            mine[t, :, :seq_len] = src[:, :, h0:h0 + hr]
        kernel.run(mine[0], mine[1], mine[2], OutTarget(None, table, geom.table_strides(), h0), geom,
                   head_dim ** -0.5)
    return window_result(flat, geom, q, k, v)


def main() -> None:
    results = {name: run_case(*args, seed=i) for i, (name, args) in enumerate(CASES.items())}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
