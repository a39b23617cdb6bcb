"""Peer-window geometry on the CPU (DESIGN §2b): strides, head offsets, padding rows, batch > 1, checked
against the definition of the post-attention All-to-All by fake pointer arithmetic (a flat CPU tensor as
the window, ``as_strided`` views as the kernels' out tensors), and the Triton table kernel through such a
window under TRITON_INTERPRET=1."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch

from xstage_dit.ops.attention.window import (WindowGeometry, head_ranges, owner_batch_strides, shard_rows,
                                             window_destination)
from xstage_dit.ops.attention.partition import shard_bounds
from xstage_dit.ops.attention.reference import attention_reference

from tests.helpers.interp import run_interp_script

GEOMETRIES = [  # world, batch, seq_len, heads, head_dim
    (1, 1, 7, 2, 4), (2, 2, 10, 5, 4), (4, 1, 9, 6, 2), (4, 2, 13, 30, 2), (8, 1, 3, 8, 2), (8, 2, 77, 30, 4),
    (3, 2, 11, 7, 2),
]


def _geom(world, batch, seq_len, heads, head_dim, extra=0):
    length = -(-seq_len // world)
    return WindowGeometry(world, batch, seq_len, heads, head_dim, length * heads * head_dim + extra)


def test_partitions_match_the_ulysses_op():
    for seq_len, world in itertools.product((1, 3, 9, 4607, 4608), (1, 2, 4, 8)):
        assert shard_rows(seq_len, world) == [n for _, n in shard_bounds(seq_len, world)]
    assert head_ranges(30, 8) == [(0, 4), (4, 4), (8, 4), (12, 4), (16, 4), (20, 4), (24, 3), (27, 3)]
    with pytest.raises(ValueError, match="heads >= world"):
        head_ranges(3, 4)


@pytest.mark.parametrize("world, batch, seq_len, heads, head_dim", GEOMETRIES)
def test_out_view_addresses_are_the_all_to_all(world, batch, seq_len, heads, head_dim):
    """Every element a rank writes through its view lands where the All-to-All puts it; the ranks together
    cover every valid element of every owner exactly once; padding rows are never addressed."""
    geom = _geom(world, batch, seq_len, heads, head_dim, extra=3)  # a slot stride larger than the buffer
    rows = geom.owner_rows()
    length = geom.rows_per_owner
    written = []
    for rank in range(world):
        spec = geom.out_view(rank)
        h0, hr = geom.heads_of(rank)
        assert spec.shape == (batch * world, length, hr, head_dim)
        assert spec.strides == (geom.slot_elems, heads * head_dim, head_dim, 1)
        assert spec.offset == h0 * head_dim
        for b, o in itertools.product(range(batch), range(world)):
            for row, h, d in itertools.product(range(rows[o]), range(hr), range(head_dim)):
                addr = spec.address((geom.slot(b, o), row, h, d))
                owner, in_buf, win = window_destination(geom, rank, b, o * length + row, h, d)
                assert (owner, win) == (o, addr)
                assert addr == geom.owner_buffer(b, o).address((row, h0 + h, d))
                assert in_buf == addr - geom.slot(b, o) * geom.slot_elems
                written.append(addr)
    assert len(written) == len(set(written)) == batch * seq_len * heads * head_dim
    padding = {geom.owner_buffer(b, o).address((r, h, d)) for b, o, first, end in geom.padding_rows()
               for r in range(first, end) for h in range(heads) for d in range(head_dim)}
    assert not padding & set(written)
    assert len(padding) == batch * (world * length - seq_len) * heads * head_dim


def test_padding_rows_and_seqused():
    geom = _geom(4, 2, 4607, 6, 8)
    assert geom.rows_per_owner == 1152
    assert geom.owner_rows() == [1152, 1152, 1152, 1151]
    assert geom.seqused_q() == [1152, 1152, 1152, 1151] * 2
    assert geom.padding_rows() == [(0, 3, 1151, 1152), (1, 3, 1151, 1152)]
    assert _geom(8, 1, 3, 8, 2).owner_rows() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert _geom(2, 1, 4608, 24, 128).padding_rows() == []
    with pytest.raises(ValueError, match="slot_elems"):
        WindowGeometry(2, 1, 10, 2, 4, 5 * 2 * 4 - 1)


def test_table_strides_and_owner_batch_view():
    geom = _geom(4, 2, 13, 30, 2, extra=10)
    assert geom.table_strides() == (4 * geom.slot_elems, 60, 2)
    # (B, P*L, Hr, D) with batch stride P*L rows: one owner-batch stride; anything else: per-batch launches.
    assert owner_batch_strides(4 * 4 * 16, 16, 2, 4, 4, 2) == (64, 16, 2, 1)
    assert owner_batch_strides(5 * 4 * 16, 16, 2, 4, 4, 2) is None
    assert owner_batch_strides(999, 16, 2, 4, 4, 1) == (64, 16, 2, 1)


def _simulate(world, batch, seq_len, heads, head_dim, dtype=torch.float32, seed=0):
    """Every rank's attention (its heads, whole sequence) written through its window view into one flat
    NaN-poisoned tensor; returns (flat window, geometry, per-owner outputs read from the owners' buffers, ref)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, seq_len, heads, head_dim, generator=gen).to(dtype) for _ in range(3))
    ref = attention_reference(q, k, v)
    geom = _geom(world, batch, seq_len, heads, head_dim, extra=5)
    flat = torch.full((geom.num_slots * geom.slot_elems,), float("nan"), dtype=dtype)
    length, rows = geom.rows_per_owner, geom.owner_rows()
    for rank in range(world):
        h0, hr = geom.heads_of(rank)
        spec = geom.out_view(rank)
        view = flat.as_strided(spec.shape, spec.strides, spec.offset)
        o_rank = attention_reference(q[:, :, h0:h0 + hr], k[:, :, h0:h0 + hr], v[:, :, h0:h0 + hr])
        padded = torch.zeros(batch, world * length, hr, head_dim, dtype=dtype)
        padded[:, :seq_len] = o_rank
        blocks = padded.view(batch * world, length, hr, head_dim)  # the owner-batch view of the result
        for i, used in enumerate(geom.seqused_q()):  # what a kernel with seqused_q writes
            view[i, :used] = blocks[i, :used]
    outs = []
    for o in range(world):
        per_b = []
        for b in range(batch):
            spec = geom.owner_buffer(b, o)
            per_b.append(flat.as_strided(spec.shape, spec.strides, spec.offset)[:rows[o]])
        outs.append(torch.stack(per_b))
    return flat, geom, outs, ref


@pytest.mark.parametrize("world, batch, seq_len, heads, head_dim", GEOMETRIES)
def test_owners_read_their_rows_of_every_head(world, batch, seq_len, heads, head_dim):
    flat, geom, outs, ref = _simulate(world, batch, seq_len, heads, head_dim)
    got = torch.cat(outs, dim=1)
    assert got.shape == ref.shape
    assert torch.equal(got, ref)  # pure data movement: exact
    for b, o, first, end in geom.padding_rows():
        pad = flat.as_strided(geom.owner_buffer(b, o).shape, geom.owner_buffer(b, o).strides,
                              geom.owner_buffer(b, o).offset)[first:end]
        assert torch.isnan(pad).all(), "a padding row was written"
    # Bytes between a buffer's end and the next slot are never touched either.
    gap = geom.slot_elems - geom.buffer_elems
    for i in range(geom.num_slots):
        start = i * geom.slot_elems + geom.buffer_elems
        assert torch.isnan(flat[start:start + gap]).all()


def test_random_geometries_cover_exactly_once():
    rnd = random.Random(7)
    for _ in range(40):
        world = rnd.choice([1, 2, 3, 4, 8])
        heads = rnd.randint(world, 3 * world + 2)
        geom = _geom(world, rnd.randint(1, 3), rnd.randint(1, 40), heads, rnd.choice([1, 2, 4]), rnd.randint(0, 9))
        seen = set()
        for rank in range(world):
            spec = geom.out_view(rank)
            for i, used in enumerate(geom.seqused_q()):
                for row, h, d in itertools.product(range(used), range(spec.shape[2]), range(spec.shape[3])):
                    seen.add(spec.address((i, row, h, d)))
        assert len(seen) == geom.batch * geom.seq_len * geom.heads * geom.head_dim


# ------------------------------------------------------------------- Triton through a window (interp)


@pytest.fixture(scope="module")
def interp_window_results() -> dict:
    return run_interp_script(Path(__file__).with_name("_window_interp_cases.py"))


@pytest.mark.parametrize("case", ["p2_b2_uneven_heads", "p4_b1_padding", "p4_b2_h30_padding", "p1_b2"])
def test_triton_table_kernel_through_a_window(interp_window_results, case):
    r = interp_window_results[case]
    assert r["shape_ok"], r
    assert not r["nan"], f"unwritten (NaN-poisoned) output: {r}"
    assert r["padding_untouched"], f"a padding row or a slot gap was written: {r}"
    assert r["rel_err"] < 1.5e-2, r


def test_schedule_names_a_kernel_or_fails_clearly():
    from xstage_dit.ops.attention import _split_schedule

    assert _split_schedule("fused:fa4") == ("fused", "fa4")
    assert _split_schedule("fused:triton") == ("fused", "triton")
    assert _split_schedule("fused:fa4-m64") == ("fused", "fa4-m64")  # by name only: not in the default sweep
    assert _split_schedule("fused:fa4-split") == ("fused", "fa4-split")  # the same, until measured
    assert _split_schedule("fused:fa4-gqa") == ("fused", "fa4-gqa")
    assert _split_schedule("serial") == ("serial", None)
    for bad in ("fused:flash", "serial:fa4", "fastest"):
        with pytest.raises(ValueError, match="fused:<kernel>"):
            _split_schedule(bad)


@pytest.mark.parametrize("seq_len, world, takes", [(4608, 8, True), (4607, 8, True), (70, 8, True),
                                                    (4608, 4, False), (1000, 8, False), (8192, 2, False)])
def test_half_tile_fa4_takes_only_slots_ending_in_a_half_tile(seq_len, world, takes):
    from xstage_dit.ops.attention.kernels import make_kernel

    length = -(-seq_len // world)
    geom = WindowGeometry(world, 1, seq_len, 24, 128, length * 24 * 128)
    reason = make_kernel("fa4-m64").supports(geom, torch.bfloat16, torch.device("cpu"), True)
    if takes:  # past the tile rule, the next refusal is FA4's own (no CUDA device here)
        assert "CUDA device" in reason, reason
    else:
        assert f"L = {length} " in reason and "half tile" in reason, reason
    assert make_kernel("fa4-m64")._impl._tiles == {"tile_mn": (64, 128)}
    assert make_kernel("fa4")._impl._tiles == {}
