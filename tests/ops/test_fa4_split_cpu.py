"""`fa4-split` on the CPU: FA4 itself needs Hopper, so a stand-in for ``_flash_attn_fwd`` (the fp32 reference
attention, honouring the same arguments: out, page_table, seqused_k, tile_mn) checks what the split adds: the
row-range views of Q and of the window, the two launches and their tiles, both K/V modes, and that nothing
outside the rank's rows and heads is written. The real kernel through the window is in
test_attention_window_gpu.py."""

from __future__ import annotations

import math

import pytest
import torch

from xstage_dit.ops.attention import fa4
from xstage_dit.ops.attention.kernels import FA4SplitTileKernel, OutTarget, make_kernel
from xstage_dit.ops.attention.reference import attention_reference
from xstage_dit.ops.attention.window import WindowGeometry


class _FakeFA4:
    """``_flash_attn_fwd`` as the window path calls it, in fp32 reference math; records every launch."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, *, softmax_scale, out, page_table=None, seqused_k=None, seqused_q=None,
                 tile_mn=None):
        assert seqused_q is None  # the split refuses S not divisible by P
        assert out.shape == q.shape, (out.shape, q.shape)
        self.calls.append({"rows": q.shape[1], "tile_mn": tile_mn, "paged": page_table is not None})
        for i in range(q.shape[0]):
            if page_table is None:
                ki, vi = k[i], v[i]
            else:
                ki = k[page_table[i].long()].flatten(0, 1)[: int(seqused_k[i])]
                vi = v[page_table[i].long()].flatten(0, 1)[: int(seqused_k[i])]
            out[i] = attention_reference(q[i][None], ki[None], vi[None], scale=softmax_scale)[0].to(out.dtype)
        return out, None


@pytest.fixture
def fake(monkeypatch):
    stand_in = _FakeFA4()
    monkeypatch.setattr(fa4, "_fwd", lambda: stand_in)
    return stand_in


@pytest.mark.parametrize("batch, length, kv", [(1, 136, "stride0"), (2, 136, "stride0"), (2, 192, "paged")])
def test_split_writes_every_row_of_the_rank_once_through_the_window(fake, batch, length, kv):
    world, heads, d, rank = 8, 16, 8, 7
    seq = world * length
    geom = WindowGeometry(world, batch, seq, heads, d, length * heads * d + 5)  # a gap after every slot
    h0, hr = geom.heads_of(rank)
    gen = torch.Generator().manual_seed(batch * 1000 + length)
    q, k, v = (torch.randn(batch, seq, hr, d, generator=gen) for _ in range(3))
    window = torch.full((geom.num_slots * geom.slot_elems,), float("nan"))
    spec = geom.out_view(rank)
    view = window.as_strided(spec.shape, spec.strides, spec.offset)
    scale = 1 / math.sqrt(d)
    kernel = make_kernel("fa4-split")
    kernel.run(q, k, v, OutTarget(view, torch.zeros(world, dtype=torch.int64), geom.table_strides(), h0), geom, scale)

    body = length - length % 128
    launches = batch if kv == "stride0" else 1
    assert [c["rows"] for c in fake.calls] == [body] * launches + [length - body] * launches
    assert [c["tile_mn"] for c in fake.calls] == [None] * launches + [(64, 128)] * launches
    assert all(c["paged"] == (kv == "paged") for c in fake.calls)
    for b in range(batch):
        want = attention_reference(q[b:b + 1], k[b:b + 1], v[b:b + 1], scale=scale)[0]
        for o in range(world):
            got = view[geom.slot(b, o)]
            torch.testing.assert_close(got, want[o * length:(o + 1) * length], rtol=1e-5, atol=1e-5)
    written = torch.zeros_like(window, dtype=torch.bool)
    written.as_strided(spec.shape, spec.strides, spec.offset).fill_(True)
    assert torch.isnan(window[~written]).all(), "a row, head or gap outside the rank's part was written"


@pytest.mark.parametrize("seq_len, world, reason", [(4608, 8, "CUDA device"), (4608, 4, "whole 128-row tiles"),
                                                    (75600, 8, "at most half a tile"), (504, 8, "at least one"),
                                                    (4607, 8, "divisible by P")])
def test_split_takes_only_slots_with_a_short_tail(seq_len, world, reason):
    length = -(-seq_len // world)
    geom = WindowGeometry(world, 1, seq_len, 24, 128, length * 24 * 128)
    got = FA4SplitTileKernel().supports(geom, torch.bfloat16, torch.device("cpu"), True)
    assert reason in got, got  # 4608 / P = 8 passes the tile rules: the next refusal is FA4's (no GPU here)


def test_row_range_is_checked(fake):
    geom = WindowGeometry(2, 1, 10, 2, 4, 5 * 2 * 4)
    q = torch.zeros(1, 10, 2, 4)
    out = torch.zeros(2, 5, 2, 4)
    impl = make_kernel("fa4")._impl
    with pytest.raises(ValueError, match=r"0 <= r0 < r1 <= L = 5"):
        impl.run(q, q, q, out, geom, 1.0, rows=(3, 3))
    odd = WindowGeometry(2, 1, 9, 2, 4, 5 * 2 * 4)
    with pytest.raises(ValueError, match="S divisible by P for a row range, got S=9, P=2"):
        impl.run(q, q, q, out, odd, 1.0, rows=(0, 2))  # q padded to P*L rows, as the op pads it
    assert not fake.calls
