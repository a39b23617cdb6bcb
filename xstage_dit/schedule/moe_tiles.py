"""Tile schedules for the persistent expert-MLP kernel: which Linear-1 / Linear-2 tile runs when.

The expert MLP of one rank is cut into row blocks: block ``b`` is ``(expert, row_start, row_end)``,
at most ``block_m`` consecutive rows of one expert in the expert-major input. Every block has

- ``n1 = ceil(intermediate / block_n1)`` Linear-1 tiles (gate and up columns of one intermediate slice,
  SwiGLU in the epilogue, result stored to the intermediate buffer), and
- ``n2 = ceil(hidden / block_n2)`` Linear-2 tiles (router weight and remote combine store in the
  epilogue), each of which needs all ``n1`` Linear-1 tiles of its block.

The order (the lead) is chosen by ``xstage_dit.schedule.moe.choose_moe_lead``; this module only builds it.

A schedule is an int32 device array ``(num_tiles, 3)`` of ``(kind, block, n)`` rows in execution order
(kind 0 = Linear-1, 1 = Linear-2). Programs take tiles in array order (atomic ticket), so as long as
every Linear-2 tile comes after all Linear-1 tiles of its block, no tile ever waits on a tile that
has not been taken: the schedule is deadlock-free for any number of resident programs, including the
sequential programs of ``TRITON_INTERPRET=1``.

Blocks are grouped into waves (``wave_blocks`` consecutive blocks, about one machine-full of Linear-1
tiles). Two orders:

- wave-by-wave (``lead=0``): for each wave, all its Linear-1 tiles, then all its Linear-2 tiles.
  Back-to-back Linear-2 tiles leave only a Linear-2 mainloop between combine bursts.
- interleaved with lead ``D >= 1``: the Linear-1 tiles of waves ``0..D-1`` first, then for each wave
  ``w`` its Linear-2 tiles evenly interleaved with the Linear-1 tiles of wave ``w + D``. The Linear-1
  mainloops between Linear-2 tiles widen the gap between combine bursts (DESIGN §2, "reshape").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

L1_TILE = 0
L2_TILE = 1


@dataclass(frozen=True)
class TileSchedule:
    """A tile schedule and the block table it indexes.

    tiles: int32 (num_tiles, 3) rows ``(kind, block, n)`` in execution order.
    blocks: int32 (num_blocks, 3) rows ``(expert, row_start, row_end)``.
    n1, n2: Linear-1 / Linear-2 tiles per block.  lead: 0 = wave-by-wave.  wave_blocks: blocks per wave.
    """

    tiles: torch.Tensor
    blocks: torch.Tensor
    n1: int
    n2: int
    lead: int
    wave_blocks: int

    @property
    def num_tiles(self) -> int:
        return int(self.tiles.shape[0])

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.shape[0])

    def to(self, device: torch.device | str) -> "TileSchedule":
        return TileSchedule(self.tiles.to(device), self.blocks.to(device), self.n1, self.n2, self.lead, self.wave_blocks)


def _blocks_array(expert_offsets, block_m: int) -> np.ndarray:
    """int64 (num_blocks, 3) rows ``(expert, row_start, row_end)``: ``row_blocks`` without a Python loop."""
    if block_m <= 0:
        raise ValueError(f"expected block_m > 0, got {block_m}")
    offs = np.asarray([int(v) for v in expert_offsets], dtype=np.int64)
    if offs.shape[0] < 2:
        raise ValueError(f"expected at least 2 expert offsets, got {offs.shape[0]}")
    sizes = np.diff(offs)
    if (sizes < 0).any():
        e = int(np.flatnonzero(sizes < 0)[0])
        raise ValueError(f"expected non-decreasing expert offsets, got {int(offs[e])} then {int(offs[e + 1])} at expert {e}")
    per_expert = -(-sizes // block_m)
    expert = np.repeat(np.arange(sizes.shape[0]), per_expert)
    first = np.repeat(np.cumsum(per_expert) - per_expert, per_expert)  # index of each expert's first block
    start = offs[expert] + (np.arange(expert.shape[0]) - first) * block_m
    return np.stack([expert, start, np.minimum(start + block_m, offs[expert + 1])], axis=1)


def row_blocks(expert_offsets: list[int], block_m: int) -> list[tuple[int, int, int]]:
    """Row blocks ``(expert, row_start, row_end)`` of an expert-major layout; empty experts have none.

    expert_offsets: ``num_experts_per_rank + 1`` non-decreasing row offsets (exclusive ends).
    """
    return [tuple(int(v) for v in row) for row in _blocks_array(expert_offsets, block_m)]


def _wave_tiles(kind: int, blocks: np.ndarray, n: int) -> np.ndarray:
    """(len(blocks) * n, 3) rows ``(kind, b, j)``, block-major: every tile of block b, then of the next."""
    return np.stack([np.full(blocks.shape[0] * n, kind), np.repeat(blocks, n), np.tile(np.arange(n), blocks.shape[0])],
                    axis=1)


def _merge_evenly(l2: np.ndarray, l1: np.ndarray) -> np.ndarray:
    """Interleave ``l1`` tiles evenly between ``l2`` tiles (Bresenham), keeping each list's order: after Linear-2
    tile i come the Linear-1 tiles j with ``i * n1 // n2 <= j < (i + 1) * n1 // n2``."""
    if not len(l2) or not len(l1):
        return np.concatenate([l2, l1]) if len(l2) else l1
    n1, n2 = len(l1), len(l2)
    targets = (np.arange(1, n2 + 1) * n1) // n2
    follows = np.searchsorted(targets, np.arange(n1), side="right")  # the L2 tile each L1 tile comes after
    # Sort keys: L2 tile i at 2*i*(n1+1), the L1 tiles after it right behind it, in their order.
    key2 = np.arange(n2) * (n1 + 1)
    key1 = follows * (n1 + 1) + 1 + (np.arange(n1) - np.searchsorted(follows, follows, side="left"))
    order = np.argsort(np.concatenate([key2, key1]), kind="stable")
    return np.concatenate([l2, l1])[order]


def build_schedule(
    expert_offsets: list[int],
    *,
    hidden: int,
    intermediate: int,
    block_m: int,
    block_n1: int,
    block_n2: int,
    lead: int = 0,
    wave_blocks: int | None = None,
    num_programs: int,
) -> TileSchedule:
    """The tile schedule for an expert-major layout with ``expert_offsets`` (see module docstring).

    lead: 0 = wave-by-wave, D >= 1 = interleaved with Linear-1 running D waves ahead.
    wave_blocks: blocks per wave; default ``ceil(num_programs / n1)`` (one machine-full of Linear-1 tiles).
    num_programs: the persistent grid (one program per SM: ``DeviceFacts.num_sms``).
    Example: ``build_schedule([0, 256, 512], hidden=2048, intermediate=1344, block_m=128, block_n1=64,
    block_n2=128, lead=2, num_programs=facts.num_sms)``.

    Built with array operations: it runs on every MoE layer call (the routing changes the offsets), and the
    Python loop it replaced, behind a host sync, kept the GPU waiting on NucleusMoE's ~8.5K tiles
    (benchmarks/results/e2e/NOTES.md, "NucleusMoE at world 1: the EP layer made it slower").
    """
    for name, v in (("hidden", hidden), ("intermediate", intermediate), ("block_n1", block_n1), ("block_n2", block_n2)):
        if v <= 0:
            raise ValueError(f"expected {name} > 0, got {v}")
    if lead < 0:
        raise ValueError(f"expected lead >= 0, got {lead}")
    blocks = _blocks_array(expert_offsets, block_m)
    n1 = -(-intermediate // block_n1)
    n2 = -(-hidden // block_n2)
    if wave_blocks is None:
        wave_blocks = max(1, -(-num_programs // n1))
    if wave_blocks <= 0:
        raise ValueError(f"expected wave_blocks > 0, got {wave_blocks}")
    nb = blocks.shape[0]
    waves = [np.arange(b, min(b + wave_blocks, nb)) for b in range(0, nb, wave_blocks)]
    empty = np.zeros((0, 3), dtype=np.int64)

    def l1(w: int) -> np.ndarray:
        return _wave_tiles(L1_TILE, waves[w], n1) if w < len(waves) else empty

    def l2(w: int) -> np.ndarray:
        return _wave_tiles(L2_TILE, waves[w], n2)

    if lead == 0:
        parts = [t for w in range(len(waves)) for t in (l1(w), l2(w))]
    else:
        parts = [l1(w) for w in range(min(lead, len(waves)))]
        parts += [_merge_evenly(l2(w), l1(w + lead)) for w in range(len(waves))]
    order = np.concatenate(parts) if parts else empty
    tiles = torch.from_numpy(np.ascontiguousarray(order, dtype=np.int32)).reshape(-1, 3)
    block_t = torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.int32)).reshape(-1, 3)
    return TileSchedule(tiles, block_t, n1, n2, lead, wave_blocks)


def check_schedule(schedule: TileSchedule) -> None:
    """Raise if some Linear-2 tile precedes one of its block's Linear-1 tiles, or a tile is missing/duplicated."""
    tiles = schedule.tiles.tolist()
    seen = set()
    done_l1 = [0] * schedule.num_blocks
    for i, (kind, b, n) in enumerate(tiles):
        if (kind, b, n) in seen:
            raise ValueError(f"expected each tile once, got {(kind, b, n)} twice (position {i})")
        seen.add((kind, b, n))
        if kind == L1_TILE:
            done_l1[b] += 1
        elif done_l1[b] != schedule.n1:
            raise ValueError(
                f"expected all {schedule.n1} Linear-1 tiles of block {b} before its Linear-2 tile at position {i}, "
                f"got {done_l1[b]}"
            )
    expected = schedule.num_blocks * (schedule.n1 + schedule.n2)
    if len(seen) != expected:
        raise ValueError(f"expected {expected} tiles, got {len(seen)}")

