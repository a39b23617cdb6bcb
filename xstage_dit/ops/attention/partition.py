"""How Ulysses attention partitions a sequence and the heads over ``P`` ranks (the one rule of the op).

Tokens: the ``torch.chunk`` convention, ``L = ceil(seq_len / P)``; rank ``r`` holds tokens
``[r*L, min((r+1)*L, seq_len))``, so only the last ranks are short (possibly empty). Heads: rank ``r``
attends ``heads // P + (r < heads % P)`` heads (``heads >= P``).
"""

from __future__ import annotations

__all__ = ["shard_bounds", "head_split"]


def shard_bounds(seq_len: int, world_size: int) -> list[tuple[int, int]]:
    """(start, length) of every rank's chunk of a ``seq_len`` sequence (``torch.chunk`` convention)."""
    chunk = -(-seq_len // world_size)
    return [(min(r * chunk, seq_len), max(0, min(chunk, seq_len - r * chunk))) for r in range(world_size)]


def head_split(heads: int, world_size: int) -> list[tuple[int, int]]:
    """(first head, head count) of every rank: the first ``heads % P`` ranks take one extra head."""
    if heads < world_size:
        raise ValueError(f"expected heads >= world size for Ulysses attention, got heads={heads} "
                         f"and world size {world_size}")
    base, rem = divmod(heads, world_size)
    out, start = [], 0
    for r in range(world_size):
        n = base + (1 if r < rem else 0)
        out.append((start, n))
        start += n
    return out
