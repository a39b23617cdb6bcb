"""The pre-attention All-to-All's other forms, on the CPU: the pitched-copy plan (the copy engine's form of
the push kernel's stores) executed as byte copies, and the library path's pack/unpack emulated with virtual
ranks, both against the definition (owner o holds every token of its heads); the driver descriptor's layout."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from xstage_dit.comm.copy_engine import CUDA_MEMCPY2D, describe_copy
from xstage_dit.ops.attention.partition import head_split, shard_bounds
from xstage_dit.ops.attention.serial import pack_for_owners, unpack_from_sources
from xstage_dit.ops.attention.window import pre_a2a_copies

CASES = [(1, 4608, 24, 8, 8), (2, 1000, 5, 8, 2), (1, 333, 7, 4, 4), (1, 70, 8, 4, 8), (2, 9, 6, 4, 4)]


def _inputs(batch, seq, heads, head_dim):
    g = torch.Generator().manual_seed(seq * heads)
    return [torch.randn((batch, seq, heads, head_dim), generator=g) for _ in range(3)]


def _expected(full, world, owner):
    """Owner o's (3, batch, P*L, Hr_max, D) buffer by definition: all tokens of its heads, the rest zero."""
    batch, seq, heads, d = full[0].shape
    length, ranges = -(-seq // world), head_split(heads, world)
    h0, hr = ranges[owner]
    want = torch.zeros((3, batch, world * length, ranges[0][1], d))
    for t in range(3):
        want[t, :, :seq, :hr] = full[t][:, :, h0:h0 + hr]
    return want


@pytest.mark.parametrize("batch,seq,heads,head_dim,world", CASES)
def test_pitched_copy_plan_fills_every_owner_buffer(batch, seq, heads, head_dim, world):
    full = _inputs(batch, seq, heads, head_dim)
    shards = [[t[:, s:s + n].contiguous() for t in full] for s, n in shard_bounds(seq, world)]
    want = [_expected(full, world, o) for o in range(world)]
    got = [torch.zeros_like(w) for w in want]
    srcs = [[t.numpy().view(np.uint8).reshape(-1) for t in shard] for shard in shards]
    dsts = [g.numpy().view(np.uint8).reshape(-1) for g in got]
    plan = pre_a2a_copies(batch=batch, seq_len=seq, heads=heads, head_dim=head_dim, world_size=world, elem_bytes=4)
    for c in plan:  # what cuMemcpy2DAsync does, row by row
        src, dst = srcs[c.src_rank][c.tensor], dsts[c.owner]
        for row in range(c.height):
            s0, d0 = c.src_offset + row * c.src_pitch, c.dst_offset + row * c.dst_pitch
            dst[d0:d0 + c.width] = src[s0:s0 + c.width]
    for o in range(world):
        assert torch.equal(got[o], want[o]), o
    assert len(plan) == 3 * batch * world * sum(1 for _, n in shard_bounds(seq, world) if n)


@pytest.mark.parametrize("batch,seq,heads,head_dim,world", CASES)
def test_library_pack_and_unpack_with_virtual_ranks(batch, seq, heads, head_dim, world):
    """The library path's bytes on one process: owner o receives chunk o of every source's send, in order."""
    full = _inputs(batch, seq, heads, head_dim)
    sends = [pack_for_owners(*[t[:, s:s + n] for t in full], world_size=world, seq_len=seq)
             for s, n in shard_bounds(seq, world)]
    for o, (_, hr) in enumerate(head_split(heads, world)):
        recv = torch.cat([send[sum(splits[:o]):sum(splits[:o + 1])] for send, splits in sends])
        got = unpack_from_sources(recv, world_size=world, batch=batch, seq_len=seq, my_heads=hr, head_dim=head_dim)
        assert torch.equal(got, _expected(full, world, o)[:, :, :, :hr]), o


def test_copy_descriptor_is_the_drivers_layout_and_checks_its_values():
    assert ctypes.sizeof(CUDA_MEMCPY2D) == 128  # cuda.h on 64-bit hosts
    assert CUDA_MEMCPY2D.dstDevice.offset == 88 and CUDA_MEMCPY2D.Height.offset == 120
    d = describe_copy(1 << 20, 1536, 2 << 20, 6144, 768, 576)
    assert (d.dstDevice, d.dstPitch, d.srcDevice, d.srcPitch, d.WidthInBytes, d.Height) == (
        1 << 20, 1536, 2 << 20, 6144, 768, 576)
    assert d.srcMemoryType == d.dstMemoryType == 2
    with pytest.raises(ValueError, match="expected src_pitch >= width_bytes = 768 for 576 rows, got 512"):
        describe_copy(1 << 20, 1536, 2 << 20, 512, 768, 576)
    with pytest.raises(ValueError, match="expected height to be a positive int, got 0"):
        describe_copy(1 << 20, 1536, 2 << 20, 6144, 768, 0)
