"""The definition of the attention ops: full non-causal attention in fp32, rounded once to q's dtype.

Tests, benchmarks and the fallback compare against these; ``ulysses_attention_reference`` gathers every
rank's chunk, attends over the whole sequence and keeps this rank's rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xstage_dit.comm.distributed import world_of
from xstage_dit.comm.staged import all_gather_chunks
from xstage_dit.ops.attention.checks import check_inputs, check_scale
from xstage_dit.ops.attention.partition import shard_bounds

__all__ = ["attention_reference", "ulysses_attention_reference"]


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Full non-causal attention in fp32, rounded to q's dtype once at the end.

    q: (batch, seq_q, heads, head_dim); k, v: (batch, seq_kv, heads, head_dim) -> (batch, seq_q, heads, head_dim).
    """
    scale = check_scale(scale, q.shape[-1])
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qf, kf, vf, scale=scale)
    return out.transpose(1, 2).to(q.dtype)


def ulysses_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
                                scale: float | None = None, seq_len: int | None = None) -> torch.Tensor:
    """The definition of ``ulysses_attention``: gather every rank's q, k, v, attend over the whole
    sequence in fp32, keep this rank's rows.

    q, k, v: (batch, seq_local, heads, head_dim) -> (batch, seq_local, heads, head_dim), q's dtype.
    """
    rank, world_size = world_of(group)
    seq_len = check_inputs(q, k, v, rank, world_size, seq_len)
    if world_size == 1:
        return attention_reference(q, k, v, scale)
    start, length = shard_bounds(seq_len, world_size)[rank]
    full_q, full_k, full_v = (all_gather_chunks(t, seq_len, group, dim=1) for t in (q, k, v))
    return attention_reference(full_q[:, start:start + length], full_k, full_v, scale)
