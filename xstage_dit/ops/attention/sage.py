"""SageAttention 1 (``sageattention`` 1.0.6, Triton): 8-bit Q K^T, 16-bit P V.

The only module that imports ``sageattention``. Its ``sageattn`` quantizes Q per 128-row and K per 64-row block to
int8 (per-block scales computed on the fly), runs P V in fp16 and returns a new (B, Sq, H, D) tensor in the input
dtype (no ``out``: the caller copies it where it belongs, `fp8_quant.store_rows`). Its ``smooth_k`` subtracts K's
mean over the sequence from the caller's K in place; here K is smoothed out of place (the same numbers: softmax is
unchanged by a shift of every key) and ``smooth_k=False`` is passed, so no input is modified. The semantics:
``fp8_reference.sage_emulation``.

It is the only SageAttention on PyPI as a wheel: SageAttention 2 / 3 (FP8 P V on Hopper) build from source with
nvcc. The version is pinned (``PINNED``) and checked before first use with a clear error.

Its kernel loads the last block of ``KEY_BLOCK`` keys under a mask but never masks their scores: a key past the
sequence is read as zero and weighs exp(0) in the softmax (with a zero value). Where the key count is not a
multiple of ``KEY_BLOCK`` the output shrinks toward zero: a rel L2 of 0.64 at 17 keys and 0.89 at 5 on an H100
(2026-12-07), 0.014 at 1,000; the same padding in fp32 torch reproduces those figures. So the kernel is refused
for such lengths (``unavailable``), and the sweep times another.
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
KEY_BLOCK = 64  # sageattention 1.0.6's BLOCK_N: the key block whose tail it leaves unmasked (module docstring)


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


def unavailable(device: torch.device, head_dim: int, kv_len: int) -> str | None:
    """Why SageAttention cannot run on ``device`` at ``head_dim`` over ``kv_len`` keys, or None."""
    refusal = capability_refusal(device, (8, 0), "SageAttention", " (its int8 Q K^T)")
    if refusal:
        return refusal
    if head_dim not in HEAD_DIMS:
        return f"SageAttention is checked at head_dim {HEAD_DIMS}, got {head_dim}"
    if kv_len % KEY_BLOCK:
        return (f"SageAttention {PINNED} weighs the {-kv_len % KEY_BLOCK} zero keys padding its last block of "
                f"{KEY_BLOCK} in the softmax: it needs a multiple of {KEY_BLOCK} keys, got {kv_len}")
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
