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


def row_blocks(expert_offsets: list[int], block_m: int) -> list[tuple[int, int, int]]:
    """Row blocks ``(expert, row_start, row_end)`` of an expert-major layout; empty experts have none.

    expert_offsets: ``num_experts_per_rank + 1`` non-decreasing row offsets (exclusive ends).
    """
    if block_m <= 0:
        raise ValueError(f"expected block_m > 0, got {block_m}")
    if len(expert_offsets) < 2:
        raise ValueError(f"expected at least 2 expert offsets, got {len(expert_offsets)}")
    blocks = []
    for e in range(len(expert_offsets) - 1):
        start, end = int(expert_offsets[e]), int(expert_offsets[e + 1])
        if end < start:
            raise ValueError(f"expected non-decreasing expert offsets, got {start} then {end} at expert {e}")
        for r in range(start, end, block_m):
            blocks.append((e, r, min(r + block_m, end)))
    return blocks


def _merge_evenly(l2: list[tuple[int, int, int]], l1: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Interleave ``l1`` tiles evenly between ``l2`` tiles (Bresenham), keeping each list's order."""
    if not l2:
        return list(l1)
    if not l1:
        return list(l2)
    out: list[tuple[int, int, int]] = []
    n1, n2 = len(l1), len(l2)
    j = 0
    for i, t in enumerate(l2):
        out.append(t)
        # After L2 tile i, place the L1 tiles whose even share falls before the next L2 tile.
        target = (i + 1) * n1 // n2
        while j < target:
            out.append(l1[j])
            j += 1
    out.extend(l1[j:])
    return out


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
    """
    for name, v in (("hidden", hidden), ("intermediate", intermediate), ("block_n1", block_n1), ("block_n2", block_n2)):
        if v <= 0:
            raise ValueError(f"expected {name} > 0, got {v}")
    if lead < 0:
        raise ValueError(f"expected lead >= 0, got {lead}")
    blocks = row_blocks(expert_offsets, block_m)
    n1 = -(-intermediate // block_n1)
    n2 = -(-hidden // block_n2)
    if wave_blocks is None:
        wave_blocks = max(1, -(-num_programs // n1))
    if wave_blocks <= 0:
        raise ValueError(f"expected wave_blocks > 0, got {wave_blocks}")
    waves = [list(range(b, min(b + wave_blocks, len(blocks)))) for b in range(0, len(blocks), wave_blocks)]

    def l1_tiles(w: int) -> list[tuple[int, int, int]]:
        if w >= len(waves):
            return []
        return [(L1_TILE, b, n) for b in waves[w] for n in range(n1)]

    def l2_tiles(w: int) -> list[tuple[int, int, int]]:
        return [(L2_TILE, b, n) for b in waves[w] for n in range(n2)]

    order: list[tuple[int, int, int]] = []
    if lead == 0:
        for w in range(len(waves)):
            order += l1_tiles(w) + l2_tiles(w)
    else:
        for w in range(min(lead, len(waves))):
            order += l1_tiles(w)
        for w in range(len(waves)):
            order += _merge_evenly(l2_tiles(w), l1_tiles(w + lead))
    tiles = torch.tensor(order, dtype=torch.int32).reshape(-1, 3)
    block_t = torch.tensor(blocks, dtype=torch.int32).reshape(-1, 3)
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

