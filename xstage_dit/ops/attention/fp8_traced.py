"""cuDNN's FP8 attention at world size 1 with its quantization written in torch, for ``torch.compile`` to fold.

    out = cudnn_fp8_attention(q, k, v, scale=None)   # q, k, v: (B, S, H, D) bf16 -> (B, S, H, D) bf16

The eager path (``fp8_kernels.CudnnFp8Kernel``) quantizes q, k and v with Triton kernels of its own (two passes
over each tensor, six launches) and dequantizes the e4m3 output in a store kernel: at FLUX's 4,608 tokens those
passes cost more than the FP8 kernel saves (NOTES: 0.574 ms against bf16's 0.399 on an H100, the kernel itself
0.279). Here the quantization (``fp8_reference.quantize_reference``, the definition) and the dequantization are
plain torch around a custom op that runs only cuDNN's kernel (``xstage_dit::cudnn_fp8_sdpa``), so that Inductor
fuses the casts into the kernels that produce q, k, v (the q/k norms and RoPE) and the one that consumes the
output (the next linear layer's activation quantization). On an H100 this took FLUX.1-dev's FP8 step from 101.7 to
99.8 ms; what it leaves is the per-tensor amax, a reduction over q, k and v before each cast can start, which
``amax_bounds`` (q's and k's, known before the call: ``features.qk_bounds``) removes for q and k.

Without bounds the values are the eager path's, bit for bit (same scales, same roundings:
``fp8_reference.cudnn_fp8_emulation`` is the definition of both); with them, q's and k's scales are the bounds'
(the same output where a bound is the true amax). ``ulysses_attention`` takes this path at world size 1 under
``torch.compile`` for the "fused:cudnn-fp8" schedule. The kernel sweep times it compiled on its own
(``window_path._world1_cases``, "cudnn-fp8+compiled") and, beside torch SDPA, inside a block's elementwise kernels
("+in-block", where its casts fold as in a step); a compiled stack chooses by those
(``schedule.attention_kernel.as_compiled``).
"""

from __future__ import annotations

import torch

from xstage_dit.ops.attention.fp8_quant import (AMAX_K, AMAX_Q, AMAX_V, DESCALE_K, DESCALE_O, DESCALE_Q, DESCALE_V,
                                                SCALE_O, Fp8QKV, check_qkv_shapes)
from xstage_dit.ops.attention.fp8_reference import E4M3, E4M3_MAX, po2_scale, quantize_reference
from xstage_dit.ops.attention.key_padding import kept_keys_first
from xstage_dit.ops.registry import NAMESPACE

__all__ = ["cudnn_fp8_attention", "quantize_scaled"]

# cuDNN reads each scale through a 16-byte-aligned pointer (the eager path's buffer: one fp32 per 16-byte row).
_ALIGN = 16


@torch.library.custom_op(f"{NAMESPACE}::cudnn_fp8_sdpa", mutates_args=())
def _cudnn_fp8_sdpa(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, scales: torch.Tensor,
                    scale: float, kv_lengths: torch.Tensor | None = None) -> torch.Tensor:
    # q8 (B, Sq, H, D), k8, v8 (B, Skv, H, D) e4m3; scales fp32 (8, 4), slot i at [i, 0] (``fp8_quant``'s
    # slots); kv_lengths int32 (B,): batch element b attends its first kv_lengths[b] keys (None: all)
    # -> O (B, Sq, H, D) e4m3 at scales[SCALE_O].
    from xstage_dit.ops.attention.cudnn_fp8 import shared_attention, unavailable_cached

    reason = unavailable_cached(str(q8.device), q8.shape[-1])
    if reason:
        raise ValueError(f"cudnn-fp8 refuses q of {tuple(q8.shape)} on {q8.device}: {reason}")
    if scales.data_ptr() % _ALIGN or not scales.is_contiguous():
        scales = scales.clone(memory_format=torch.contiguous_format)  # a fresh allocation is aligned
    x = Fp8QKV(q8.contiguous(), k8.contiguous(), v8.contiguous(), scales)
    if kv_lengths is None:
        return shared_attention().run(x, scale)
    return shared_attention().run(x, scale, kv_lengths=kv_lengths.contiguous())


@_cudnn_fp8_sdpa.register_fake
def _(q8, k8, v8, scales, scale, kv_lengths=None):
    return torch.empty_like(q8, memory_format=torch.contiguous_format)


def quantize_scaled(x: torch.Tensor, amax_bound: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape, floating) -> (e4m3 of x's shape, contiguous; scale: fp32 0-dim, a power of two):
    ``fp8_reference.quantize_reference``'s values, returning the scale instead of the descale. ``amax_bound``: a
    bound on |x| known in advance (``features.qk_bounds``) that the scale is taken from instead of x's amax (no
    reduction over x before the cast); values past it saturate at e4m3's largest."""
    if amax_bound is None:
        x8, descale = quantize_reference(x)
        return x8, 1.0 / descale.reshape(())  # powers of two: the reciprocal is exact
    scale = po2_scale(amax_bound)
    return (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).contiguous(), scale


def cudnn_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                        amax_bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
                        key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v through cuDNN's FP8 forward, quantization and dequantization in torch.

    q: (B, Sq, H, D), k, v: (B, Skv, H, D), bf16 or fp16, on one CUDA device -> (B, Sq, H, D) in q's dtype,
    contiguous. scale: default 1/sqrt(D). amax_bounds: (bound on |q|, bound on |k|), fp32 0-dim tensors known
    before the call (``features.qk_bounds``): q's and k's scales from them, so their casts need no pass of their own.
    key_mask: bool (B | 1, Skv) or (B | 1, 1, 1, Skv), True for a key attended (a text's padding masked out), at
    least one a batch element (`kept_keys_first`; k's and v's scales still cover every key).
    Values: ``fp8_reference.cudnn_fp8_emulation`` (per-tensor power-of-two scales, O rounded to e4m3 at half of V's
    scale), with q's and k's scales those of the bounds where given.
    """
    check_qkv_shapes(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    kv_lengths = None
    if key_mask is not None:
        k, v, kv_lengths = kept_keys_first(k, v, key_mask)
    bq, bk = (None, None) if amax_bounds is None else amax_bounds
    (q8, sq), (k8, sk), (v8, sv) = quantize_scaled(q, bq), quantize_scaled(k, bk), quantize_scaled(v)
    slots = {AMAX_Q: sq, AMAX_K: sk, AMAX_V: sv, DESCALE_Q: 1.0 / sq, DESCALE_K: 1.0 / sk, DESCALE_V: 1.0 / sv,
             SCALE_O: sv * 0.5, DESCALE_O: 2.0 / sv}  # the amax slots hold the scales: cuDNN reads none of them
    scales = torch.nn.functional.pad(torch.stack([slots[i] for i in range(len(slots))]).reshape(-1, 1), (0, 3))
    o8 = torch.ops.xstage_dit.cudnn_fp8_sdpa(q8, k8, v8, scales, scale, kv_lengths)
    return (o8.float() * slots[DESCALE_O]).to(q.dtype)
