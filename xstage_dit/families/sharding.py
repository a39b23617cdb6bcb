"""The one sequence split rule, and the shard / gather collectives built on it.

Split rule (`split_sizes`): balanced contiguous shards in rank order, sizes differing by at most one
token, the longer ones first (``split_sizes(9, 4) == [3, 2, 2, 2]``), so no rank's shard is empty
while there are at least as many tokens as ranks (`check_splittable` refuses fewer, on every rank
alike). Every place that decides which tokens a rank owns (the entry hooks, the attention backend for
replicated tails, the exit gather) calls this function. When ``total`` divides by ``parts`` the shards
are the equal chunks of the Ulysses op (`xstage_dit.ops.attention.partition.shard_bounds`), the only case in
which the backend hands shards to the op (a test checks the two rules agree there); otherwise the
backend gathers keys and values, which works for any split.

The collectives are `xstage_dit.comm.staged`'s (the one copy of host staging for gloo), which wait
failure-aware on gloo: a peer that failed in the middle of a forward (and published its error) stops
this rank at once with the peer's error, instead of leaving it in the all-gather until the timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from xstage_dit.comm.staged import all_gather_dim0

__all__ = ["split_sizes", "split_offsets", "check_splittable", "shard", "gather", "all_gather_dim0"]


def split_sizes(total: int, parts: int) -> list[int]:
    """Tokens per rank: ``total // parts`` each, one more on the first ``total % parts`` ranks.

    Example: ``split_sizes(10, 4) == [3, 3, 2, 2]``, ``split_sizes(9, 4) == [3, 2, 2, 2]``,
    ``split_sizes(8, 4) == [2, 2, 2, 2]`` (the op's equal chunks).
    """
    if parts < 1:
        raise ValueError(f"expected parts >= 1, got {parts}")
    if total < 0:
        raise ValueError(f"expected total >= 0, got {total}")
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def check_splittable(total: int, parts: int, what: str) -> None:
    """Raise ValueError (the same on every rank: it depends only on the full length) when a sequence of
    `total` tokens would leave a rank with an empty shard. Model code (rotary embeddings, reshapes
    with ``-1``) fails on empty tensors, and it would fail on that rank alone."""
    if 0 < total < parts:
        raise ValueError(
            f"expected at least sp={parts} tokens in {what} to split over {parts} ranks, got {total} "
            f"(a rank would hold none); use a smaller sp or a longer input"
        )


def split_offsets(total: int, parts: int) -> list[int]:
    """Start index of each rank's shard under `split_sizes` (length ``parts + 1``; last = total)."""
    offsets = [0]
    for size in split_sizes(total, parts):
        offsets.append(offsets[-1] + size)
    return offsets


def shard(x: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    """This rank's slice of `x` along `dim` (a view, no communication)."""
    offsets = split_offsets(x.shape[dim], parts)
    return x.narrow(dim, offsets[rank], offsets[rank + 1] - offsets[rank])


def gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup, total: int | None = None) -> torch.Tensor:
    """Concatenate every rank's shard of `x` along `dim` (inverse of `shard`), on all ranks.

    total: the full length along `dim` if known (then no size exchange is needed); otherwise the
    ranks exchange their lengths first (one small extra collective).
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    x = x.contiguous()
    if total is None:
        sizes = _exchange_sizes(x.shape[dim], group, x.device)
    else:
        sizes = split_sizes(total, world)
        if sizes[rank] != x.shape[dim]:
            raise ValueError(
                f"expected a shard of {sizes[rank]} tokens on rank {rank} (total {total} over {world}), "
                f"got {x.shape[dim]}"
            )
    pad_to = max(sizes)
    if x.shape[dim] < pad_to:
        pad_shape = list(x.shape)
        pad_shape[dim] = pad_to - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    # Equal-size all-gather on dim 0 is the fastest collective on both NCCL and gloo.
    moved = x.movedim(dim, 0).contiguous()
    out = all_gather_dim0(moved, group)
    pieces = [out[r * pad_to : r * pad_to + sizes[r]] for r in range(world)]
    return torch.cat(pieces, dim=0).movedim(0, dim)


def _exchange_sizes(local: int, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    mine = torch.tensor([local], dtype=torch.int64, device=device)
    return [int(n) for n in all_gather_dim0(mine, group).tolist()]
