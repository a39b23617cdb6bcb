"""`fa4-split`, `fa4-gqa` and `fa4-gqa-unpacked` on the CPU: FA4 itself needs Hopper, so a stand-in for
``_flash_attn_fwd`` (the fp32 reference attention, honouring the same arguments: out, page_table, seqused_k,
tile_mn, and GQA: query head h attends KV head h // (Hq / Hkv)) checks what these launches add: the row-range
and owners-as-heads views of Q, K/V and the window, the launches and their tiles, both K/V modes, and that
nothing outside the rank's rows and heads is written. The real kernels through the window are in
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
        self.pack_gqa = []  # what each launch asked for (None: FA4's own choice)

    def __call__(self, q, k, v, *, softmax_scale, out, page_table=None, seqused_k=None, seqused_q=None,
                 tile_mn=None, pack_gqa=None):
        assert seqused_q is None  # both launches refuse S not divisible by P
        self.pack_gqa.append(pack_gqa)
        assert out.shape == q.shape, (out.shape, q.shape)
        assert 0 not in out.stride() and out.stride(-1) == 1  # FA4's validate_output_layout
        self.calls.append({"rows": q.shape[1], "tile_mn": tile_mn, "paged": page_table is not None,
                           "heads": q.shape[2], "kv_heads": v.shape[2], "batch": q.shape[0]})
        group = q.shape[2] // v.shape[2]
        for i in range(q.shape[0]):
            if page_table is None:
                ki, vi = k[i], v[i]
            else:
                ki = k[page_table[i].long()].flatten(0, 1)[: int(seqused_k[i])]
                vi = v[page_table[i].long()].flatten(0, 1)[: int(seqused_k[i])]
            ki, vi = (t.repeat_interleave(group, dim=1) for t in (ki, vi))  # GQA: head h reads KV head h // group
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


@pytest.mark.parametrize("batch, world, length, extra_rows", [(1, 8, 72, 0), (2, 8, 136, 0), (2, 4, 50, 0),
                                                             (1, 1, 40, 0), (2, 4, 50, 3)])
def test_owners_as_query_heads_write_every_row_of_the_rank_once(fake, batch, world, length, extra_rows):
    heads, d = 16, 8
    rank = world - 1
    seq = world * length
    geom = WindowGeometry(world, batch, seq, heads, d, length * heads * d + 7)
    h0, hr = geom.heads_of(rank)
    gen = torch.Generator().manual_seed(batch * 100 + world)
    # q, k, v as the window path hands them: the rank's heads of the gathered sequence, here with a row stride
    # wider than Hr*D (a view into a larger buffer), to check the views use the strides they are given; with
    # extra rows past P*L the batch elements cannot be one head index (one launch each).
    buf = torch.randn(3, batch, seq + extra_rows, hr + 1, d, generator=gen)
    q, k, v = buf[0, :, :, :hr], buf[1, :, :, :hr], buf[2, :, :, :hr]
    window = torch.full((geom.num_slots * geom.slot_elems,), float("nan"))
    spec = geom.out_view(rank)
    view = window.as_strided(spec.shape, spec.strides, spec.offset)
    scale = 1 / math.sqrt(d)
    make_kernel("fa4-gqa").run(q, k, v, OutTarget(view, torch.zeros(world, dtype=torch.int64),
                                                  geom.table_strides(), h0), geom, scale)

    if extra_rows:  # one launch per batch element, its P owners the query heads of one KV head
        want = [{"rows": length, "tile_mn": None, "paged": False, "heads": world, "kv_heads": 1, "batch": hr}] * batch
    else:  # one launch: query head b*P + o, KV head b
        want = [{"rows": length, "tile_mn": None, "paged": False, "heads": batch * world, "kv_heads": batch,
                 "batch": hr}]
    assert fake.calls == want
    for b in range(batch):
        want = attention_reference(q[b:b + 1, :seq], k[b:b + 1, :seq], v[b:b + 1, :seq], scale=scale)[0]
        for o in range(world):
            torch.testing.assert_close(view[geom.slot(b, o)], want[o * length:(o + 1) * length], rtol=1e-5,
                                       atol=1e-5)
    written = torch.zeros_like(window, dtype=torch.bool)
    written.as_strided(spec.shape, spec.strides, spec.offset).fill_(True)
    assert torch.isnan(window[~written]).all(), "a row, head or gap outside the rank's part was written"


def test_owners_as_query_heads_refuse_uneven_shards(fake):
    geom = WindowGeometry(8, 1, 4607, 24, 128, 576 * 24 * 128)
    assert "S divisible by P" in make_kernel("fa4-gqa").supports(geom, torch.bfloat16, torch.device("cpu"), True)
    even = WindowGeometry(8, 1, 4608, 24, 128, 576 * 24 * 128)
    assert "CUDA device" in make_kernel("fa4-gqa").supports(even, torch.bfloat16, torch.device("cpu"), True)
    q = torch.zeros(1, 4608, 3, 128)
    with pytest.raises(ValueError, match="S divisible by P for owners as heads, got S=4607, P=8"):
        make_kernel("fa4")._impl.run_owner_heads(q, q, q, torch.zeros(8, 576, 3, 128), geom, 1.0)
    assert not fake.calls


@pytest.mark.parametrize("batch, world, length", [(1, 2, 256), (2, 4, 128)])
def test_unpacked_owner_heads_write_the_same_rows_and_never_pack(fake, batch, world, length):
    heads, d = 8, 8
    rank = world - 1
    seq = world * length
    geom = WindowGeometry(world, batch, seq, heads, d, length * heads * d + 3)
    h0, hr = geom.heads_of(rank)
    gen = torch.Generator().manual_seed(7 * batch + world)
    q, k, v = (torch.randn(batch, seq, hr, d, generator=gen) for _ in range(3))
    spec = geom.out_view(rank)
    scale = 1 / math.sqrt(d)
    views = {}
    for name in ("fa4-gqa", "fa4-gqa-unpacked"):
        window = torch.full((geom.num_slots * geom.slot_elems,), float("nan"))
        views[name] = (window, window.as_strided(spec.shape, spec.strides, spec.offset))
        make_kernel(name).run(q, k, v, OutTarget(views[name][1], torch.zeros(world, dtype=torch.int64),
                                                 geom.table_strides(), h0), geom, scale)
    assert fake.pack_gqa == [None, False]  # packed: FA4's default; unpacked: asked for explicitly
    assert fake.calls[0] == fake.calls[1]  # the same launch otherwise
    packed, unpacked = views["fa4-gqa"], views["fa4-gqa-unpacked"]
    torch.testing.assert_close(unpacked[0], packed[0], equal_nan=True)  # same rows written, nothing else
    for b in range(batch):
        want = attention_reference(q[b:b + 1], k[b:b + 1], v[b:b + 1], scale=scale)[0]
        for o in range(world):
            torch.testing.assert_close(unpacked[1][geom.slot(b, o)], want[o * length:(o + 1) * length], rtol=1e-5,
                                       atol=1e-5)


def test_unpacked_owner_heads_refuse_part_tiles():
    unpacked = make_kernel("fa4-gqa-unpacked")
    flux = WindowGeometry(8, 1, 4608, 24, 128, 576 * 24 * 128)  # L = 576 = 4 x 128 + 64
    assert "L = 576 ends in 64 rows (fa4-gqa packs those)" in unpacked.supports(flux, torch.bfloat16,
                                                                                torch.device("cuda"), True)
    uneven = WindowGeometry(8, 1, 8191, 24, 128, 1024 * 24 * 128)
    assert "S divisible by P" in unpacked.supports(uneven, torch.bfloat16, torch.device("cuda"), True)
    whole = WindowGeometry(2, 1, 32768, 40, 128, 16384 * 40 * 128)
    assert "CUDA device" in unpacked.supports(whole, torch.bfloat16, torch.device("cpu"), True)
