"""The serial schedule: library All-to-All (NCCL on GPUs, gloo on CPUs) before and after the best
single-device attention (cuDNN SDPA on the GPU). The baseline and the fallback of the fused schedule.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xstage_dit.comm.distributed import world_of
from xstage_dit.comm.staged import all_to_all_rows
from xstage_dit.ops.attention.checks import FUSED_DTYPES, check_inputs, check_scale
from xstage_dit.ops.attention.partition import head_split

__all__ = ["sdpa", "library_pre_all_to_all", "pack_for_owners", "serial_attention", "unpack_from_sources"]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Best single-device attention on (batch, seq, heads, head_dim): cuDNN SDPA on the GPU."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if q.is_cuda and q.dtype in FUSED_DTYPES:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                          SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
    return out.transpose(1, 2)


def pack_for_owners(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, world_size: int, seq_len: int
                    ) -> tuple[torch.Tensor, list[int]]:
    """The library pre-A2A's send buffer: q, k, v (batch, seq_local, heads, head_dim) -> flat send, owner j's
    chunk (3, batch, ceil(seq_len/P), heads_j, head_dim) at offset sum(splits[:j]); returns (send, splits)."""
    batch, seq_local, heads, head_dim = q.shape
    chunk = -(-seq_len // world_size)
    heads_of = head_split(heads, world_size)
    qkv = torch.zeros((3, batch, chunk, heads, head_dim), dtype=q.dtype, device=q.device)
    qkv[0, :, :seq_local], qkv[1, :, :seq_local], qkv[2, :, :seq_local] = q, k, v
    send = torch.cat([qkv[:, :, :, h0:h0 + n].reshape(-1) for h0, n in heads_of])
    elems = 3 * batch * chunk * head_dim
    return send, [elems * n for _, n in heads_of]


def unpack_from_sources(recv: torch.Tensor, *, world_size: int, batch: int, seq_len: int, my_heads: int,
                        head_dim: int) -> torch.Tensor:
    """The owner's side: the P sources' chunks, in source order -> (3, batch, P*chunk, my_heads, head_dim)."""
    chunk = -(-seq_len // world_size)
    return (recv.view(world_size, 3, batch, chunk, my_heads, head_dim).permute(1, 2, 0, 3, 4, 5)
            .reshape(3, batch, world_size * chunk, my_heads, head_dim))


def library_pre_all_to_all(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, rank: int, world_size: int,
                           seq_len: int) -> torch.Tensor:
    """Tokens -> heads with one library ``all_to_all_single`` (NCCL on GPUs, gloo on CPUs).

    q, k, v: (batch, seq_local, heads, head_dim) -> (3, batch, P*ceil(seq_len/P), my_heads, head_dim), rows
    past seq_len zero.
    """
    batch, _, heads, head_dim = q.shape
    my_heads = head_split(heads, world_size)[rank][1]
    send, splits = pack_for_owners(q, k, v, world_size=world_size, seq_len=seq_len)
    recv = all_to_all_rows(send, splits, [splits[rank]] * world_size, group)
    return unpack_from_sources(recv, world_size=world_size, batch=batch, seq_len=seq_len, my_heads=my_heads,
                               head_dim=head_dim)


def serial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, scale: float | None = None,
                     seq_len: int | None = None) -> torch.Tensor:
    """Library All-to-All + single-device SDPA + library All-to-All (the baseline schedule)."""
    rank, world_size = world_of(group)
    seq_len = check_inputs(q, k, v, rank, world_size, seq_len)
    scale = check_scale(scale, q.shape[-1])
    if world_size == 1:
        return sdpa(q, k, v, scale).contiguous()
    batch, seq_local, heads, head_dim = q.shape
    chunk = -(-seq_len // world_size)
    heads_of = head_split(heads, world_size)
    my_heads = heads_of[rank][1]
    full = library_pre_all_to_all(q, k, v, group=group, rank=rank, world_size=world_size, seq_len=seq_len)
    full = full[:, :, :seq_len]
    out = sdpa(full[0], full[1], full[2], scale)
    # Post: rank i gets rows [i*chunk, (i+1)*chunk) of my heads; I get my rows of everyone's heads.
    out_pad = torch.zeros((batch, world_size * chunk, my_heads, head_dim), dtype=q.dtype, device=q.device)
    out_pad[:, :seq_len] = out
    send = out_pad.view(batch, world_size, chunk, my_heads, head_dim).transpose(0, 1).reshape(-1)
    elems = batch * chunk * head_dim
    recv = all_to_all_rows(send, [elems * my_heads] * world_size, [elems * n for _, n in heads_of], group)
    parts, offset = [], 0
    for _, n in heads_of:
        parts.append(recv[offset:offset + elems * n].view(batch, chunk, n, head_dim))
        offset += elems * n
    return torch.cat(parts, dim=2)[:, :seq_local].contiguous()
