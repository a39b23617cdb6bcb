"""Input validation of the attention ops: shapes, dtypes, devices, the shard a rank holds, the scale, and
what the fused kernel supports. Every public function of the package calls these before any work.
"""

from __future__ import annotations

import math

import torch

from xstage_dit.ops.attention.partition import head_split, shard_bounds
from xstage_dit.ops.triton_alloc import interpreting

__all__ = ["FUSED_DTYPES", "FUSED_HEAD_DIMS", "check_inputs", "check_scale", "fused_unavailable",
           "fused_unavailable_for"]

FUSED_DTYPES = (torch.float16, torch.bfloat16)
FUSED_HEAD_DIMS = (16, 32, 64, 128)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, world_size: int,
                  seq_len: int | None) -> int:
    """Validate q, k, v (batch, seq_local, heads, head_dim) of rank ``rank`` of ``world_size``; return seq_len."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected {name} to be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"expected {name} of shape (batch, seq_local, heads, head_dim), got {tuple(t.shape)}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"expected q, k, v of one shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"expected q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"expected q, k, v on one device, got {q.device}, {k.device}, {v.device}")
    if not q.is_floating_point():
        raise ValueError(f"expected a floating-point dtype, got {q.dtype}")
    batch, seq_local, heads, head_dim = q.shape
    if batch < 1 or heads < 1 or head_dim < 1:
        raise ValueError(f"expected batch, heads, head_dim >= 1, got {tuple(q.shape)}")
    if seq_len is None:
        seq_len = seq_local * world_size
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"expected seq_len to be a positive int (the whole sequence), got {seq_len!r}")
    expected = shard_bounds(seq_len, world_size)[rank][1]
    if seq_local != expected:
        raise ValueError(f"expected rank {rank} of {world_size} to hold {expected} tokens of a {seq_len}-token "
                         f"sequence (chunks of ceil(seq_len / world)), got seq_local={seq_local}")
    head_split(heads, world_size)
    return seq_len


def check_scale(scale: float | None, head_dim: int) -> float:
    """The softmax scale: ``1/sqrt(head_dim)`` for None, else a positive finite number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"expected scale to be a positive finite number, got {scale!r}")
    return float(scale)


def fused_unavailable_for(dtype: torch.dtype, head_dim: int, device: torch.device) -> str | None:
    """Why the fused kernel cannot run on tensors of ``dtype``, ``head_dim`` and ``device``, or None."""
    if dtype not in FUSED_DTYPES:
        return f"expected dtype float16 or bfloat16 for the fused kernel, got {dtype}"
    if head_dim not in FUSED_HEAD_DIMS:
        return f"expected head_dim in {FUSED_HEAD_DIMS} for the fused kernel, got {head_dim}"
    if torch.device(device).type != "cuda" and not interpreting():
        return f"expected a CUDA device (or TRITON_INTERPRET=1) for the fused kernel, got {device}"
    return None


def fused_unavailable(q: torch.Tensor) -> str | None:
    """Why the fused kernel cannot run on q (batch, seq, heads, head_dim), or None when it can."""
    return fused_unavailable_for(q.dtype, q.shape[-1], q.device)
