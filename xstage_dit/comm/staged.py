"""Collectives that work on every backend the project runs on, written once.

gloo has no CUDA collectives, and gloo is what ranks sharing one GPU use for control (NCCL refuses two
ranks on one GPU), so a CUDA tensor going through a gloo group is staged through the host; NCCL takes
it as it is. Every caller that moves rows between ranks goes through these functions.

Shapes: ``all_to_all_rows(send (n, ...), send_splits, recv_splits) -> (sum(recv_splits), ...)``;
``all_gather_list(t) -> [t of rank 0, t of rank 1, ...]``; ``all_gather_dim0(x (n, ...)) -> (world*n, ...)``;
``all_gather_chunks(x (batch, seq_local_r, ...), seq_len) -> (batch, seq_len, ...)`` (unequal chunks).

On gloo (which blocks the host) every collective here waits through `xstage_dit.comm.agreement.wait`:
when a peer failed in the middle of a forward and published its error, this rank stops at once with
that error instead of sitting in the collective until the timeout. NCCL and traced (torch.compile)
calls run the plain collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from xstage_dit.comm import agreement
from xstage_dit.comm.distributed import world_of

__all__ = ["is_gloo", "needs_host_staging", "all_to_all_rows", "all_gather_list", "all_gather_dim0",
           "all_gather_chunks"]

# torch >= 2.4 names it all_gather_into_tensor; all_gather_single is the older private spelling.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def is_gloo(group: dist.ProcessGroup | None) -> bool:
    """True when ``group`` runs on the gloo backend."""
    return str(dist.get_backend(group)) == "gloo"


def needs_host_staging(t: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """A CUDA tensor through a gloo group must go through the host."""
    return t.is_cuda and is_gloo(group)


def _collective(fn, *args, group, **kwargs) -> None:
    if torch.compiler.is_compiling() or not is_gloo(group):
        fn(*args, group=group, **kwargs)
    else:
        agreement.wait(fn(*args, group=group, async_op=True, **kwargs), group)


def all_to_all_rows(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """``all_to_all_single`` of rows (dim 0) with split sizes; returns (sum(recv_splits), *send.shape[1:])."""
    _, world = world_of(group)
    if world == 1:
        return send
    staged = needs_host_staging(send, group)
    src = send.contiguous().cpu() if staged else send.contiguous()
    recv = src.new_empty((sum(recv_splits), *send.shape[1:]))
    _collective(dist.all_to_all_single, recv, src, recv_splits, send_splits, group=group)
    return recv.to(send.device) if staged else recv


def all_gather_list(t: torch.Tensor, group) -> list[torch.Tensor]:
    """all_gather of equal-shape tensors, in rank order (on ``t``'s device)."""
    _, world = world_of(group)
    if world == 1:
        return [t]
    staged = needs_host_staging(t, group)
    src = t.contiguous().cpu() if staged else t.contiguous()
    parts = [torch.empty_like(src) for _ in range(world)]
    _collective(dist.all_gather, parts, src, group=group)
    return [p.to(t.device) for p in parts] if staged else parts


def all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """``(n, ...)`` on each rank -> ``(world * n, ...)`` in rank order, one collective."""
    _, world = world_of(group)
    if world == 1:
        return x
    staged = needs_host_staging(x, group)
    src = x.contiguous().cpu() if staged else x.contiguous()
    out = src.new_empty((world * src.shape[0], *src.shape[1:]))
    _collective(_all_gather_single, out, src, group=group)
    return out.to(x.device, non_blocking=True) if staged else out


def all_gather_chunks(x: torch.Tensor, seq_len: int, group, dim: int = 1) -> torch.Tensor:
    """Every rank's ``torch.chunk`` piece of a ``seq_len`` dimension ``dim`` -> the whole, in rank order.

    x: (..., seq_local_r, ...) with ``seq_local_r`` rank r's chunk (``ceil(seq_len / world)`` tokens, the
    last ranks shorter or empty) -> (..., seq_len, ...). Chunks are padded to one size for the collective.
    """
    _, world = world_of(group)
    if world == 1:
        return x
    chunk = -(-seq_len // world)
    if x.shape[dim] > chunk:
        raise ValueError(f"expected at most ceil({seq_len} / {world}) = {chunk} rows along dim {dim}, got {x.shape[dim]}")
    pad_shape = list(x.shape)
    pad_shape[dim] = chunk
    pad = x.new_zeros(pad_shape)
    pad.narrow(dim, 0, x.shape[dim]).copy_(x)
    return torch.cat(all_gather_list(pad, group), dim=dim).narrow(dim, 0, seq_len)
