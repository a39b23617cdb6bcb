"""The one sequence split rule, and the shard / gather collectives built on it.

Split rule (`split_sizes`): the ``torch.chunk`` convention of `xstage_dit.ops.attention.partition`
(``shard_bounds``): chunks of ``ceil(total / parts)`` tokens in rank order, so only the last ranks are
short (possibly empty). Every place that decides which tokens a rank owns (the entry hooks, the
attention backend for replicated tails, the exit gather) calls this function, so the shards agree
with the attention op on token ownership (a test checks the two functions give the same bounds).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (same arguments); the GPU machine has 2.11.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def split_sizes(total: int, parts: int) -> list[int]:
    """Tokens per rank: chunks of ``ceil(total / parts)``, the remainder on the last non-empty rank.

    Example: ``split_sizes(10, 4) == [3, 3, 3, 1]``, ``split_sizes(5, 4) == [2, 2, 1, 0]``.
    """
    if parts < 1:
        raise ValueError(f"expected parts >= 1, got {parts}")
    if total < 0:
        raise ValueError(f"expected total >= 0, got {total}")
    chunk = -(-total // parts)
    return [max(0, min(chunk, total - r * chunk)) for r in range(parts)]


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


def all_gather_dim0(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``(n, ...)`` on each rank -> ``(world * n, ...)`` in rank order. gloo (ranks sharing one GPU) stages
    CUDA tensors through the host: it has no CUDA all-gather."""
    world = dist.get_world_size(group)
    staged = x.is_cuda and str(dist.get_backend(group)) == "gloo"
    src = x.cpu() if staged else x
    out = src.new_empty((world * src.shape[0], *src.shape[1:]))
    _all_gather_single(out, src, group=group)
    return out.to(x.device, non_blocking=True) if staged else out


def _exchange_sizes(local: int, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    world = dist.get_world_size(group)
    backend = str(dist.get_backend(group))
    sizes_device = torch.device("cpu") if backend == "gloo" else device
    mine = torch.tensor([local], dtype=torch.int64, device=sizes_device)
    out = torch.empty(world, dtype=torch.int64, device=sizes_device)
    _all_gather_single(out, mine, group=group)
    return [int(s) for s in out.tolist()]
