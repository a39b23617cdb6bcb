"""SageAttention 1 (``sageattention`` 1.0.6, Triton): 8-bit Q K^T, 16-bit P V.

The only module that imports ``sageattention``. Its ``sageattn`` quantizes Q per 128-row and K per 64-row block to
int8 (per-block scales computed on the fly), runs P V in fp16 and returns a new (B, Sq, H, D) tensor in the input
dtype (no ``out``: the caller copies it where it belongs, `fp8_quant.store_rows`). Its ``smooth_k`` subtracts K's
mean over the sequence from the caller's K in place; here K is smoothed out of place (the same numbers: softmax is
unchanged by a shift of every key) and ``smooth_k=False`` is passed, so no input is modified. The semantics:
``fp8_reference.sage_emulation``.

It is the only SageAttention on PyPI as a wheel: SageAttention 2 / 3 (FP8 P V on Hopper) build from source with
nvcc. The version is pinned (``PINNED``) and checked before first use with a clear error.
"""

from __future__ import annotations

import functools
from importlib import metadata

import torch

from xstage_dit.ops.capability import capability_refusal

__all__ = ["DISTRIBUTION", "PINNED", "sage_attention", "unavailable", "version"]

DISTRIBUTION = "sageattention"
PINNED = "1.0.6"
HEAD_DIMS = (64, 128)


class SageUnavailable(RuntimeError):
    """sageattention is missing or not the pinned version."""


def version() -> str | None:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def _sageattn():
    found = version()
    if found != PINNED:
        raise SageUnavailable(f"expected {DISTRIBUTION}=={PINNED} (pip install 'xstage-dit[gpu]'), got "
                              f"{found or 'none'}")
    try:
        from sageattention import sageattn
    except Exception as exc:  # noqa: BLE001 - an install that does not import is an unavailable kernel, with why
        raise SageUnavailable(f"expected {DISTRIBUTION}=={PINNED} to import, got {type(exc).__name__}: {exc}") from exc
    return sageattn


def unavailable(device: torch.device, head_dim: int) -> str | None:
    """Why SageAttention cannot run on ``device`` at ``head_dim``, or None."""
    refusal = capability_refusal(device, (8, 0), "SageAttention", " (its int8 Q K^T)")
    if refusal:
        return refusal
    if head_dim not in HEAD_DIMS:
        return f"SageAttention is checked at head_dim {HEAD_DIMS}, got {head_dim}"
    try:
        _sageattn()
    except SageUnavailable as exc:
        return str(exc)
    return None


def sage_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: (B, Sq, H, D), k, v: (B, Skv, H, D), bf16/fp16 with a contiguous last dim -> (B, Sq, H, D) in q's dtype,
    ``softmax(q k^T * scale) v`` with 8-bit Q K^T. No input is modified."""
    smoothed = k - k.mean(dim=1, keepdim=True)
    return _sageattn()(q, smoothed, v, tensor_layout="NHD", is_causal=False, sm_scale=scale, smooth_k=False)
