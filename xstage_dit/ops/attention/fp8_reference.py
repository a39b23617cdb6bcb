"""The definitions of FP8 attention, in torch: how q, k, v become float8 e4m3, and the attention each 8-bit kernel
computes, emulated in fp32 with its roundings (the CPU tests, the GPU tests' bounds and the error benchmark call
these; the kernels themselves are `fp8_quant` (Triton) and `fp8_kernels` (cuDNN, SageAttention)).

Scales (per tensor, computed on the fly from the tensor itself, no host sync):

    scale = 2 ** floor(log2(448 / amax(|x|)))        x_fp8 = e4m3(x * scale)        x ~= x_fp8 / scale

A power of two, so ``x * scale`` and the descale ``1 / scale`` are exact and the e4m3 rounding (round to nearest
even) is the only error; ``amax * scale`` lies in (224, 448], so nothing overflows e4m3's largest finite 448.

``cudnn_fp8_emulation``: cuDNN's FP8 SDPA forward on Hopper (cuDNN 9.x): Q K^T of the e4m3 tensors in fp32, the
softmax numerator P = exp(S - rowmax) in [0, 1] rounded to e4m3 at ``P_SCALE``, P V in fp32 divided by the
unrounded row sum, and O rounded to e4m3 (Hopper's cuDNN writes no bf16 O from FP8 inputs) at ``scale_v / 2``: |O|
<= amax(V) * (1 + P's rounding), so half of V's scale leaves O a binade of headroom. The kernel rounds P against a
running row maximum, the emulation against the final one: the same rounding, at slightly different points.

``sage_emulation``: SageAttention 1's recipe (``sageattention`` 1.0.6): K smoothed (its mean over the sequence
subtracted: exact for softmax), Q per 128-row and K per 64-row block to int8 (scale amax / 127, round half away
from zero), the scores in fp32, P and V in fp16, O in the input dtype.
"""

from __future__ import annotations

import math

import torch

__all__ = ["E4M3", "E4M3_MAX", "P_SCALE", "cudnn_fp8_emulation", "po2_scale", "quantize_reference", "rel_l2",
           "sage_emulation"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# The scale of the softmax numerator P in [0, 1] before its e4m3 rounding: a power of two (exact descale) under
# 448, as cuDNN's own tests scale it.
P_SCALE = 256.0
# amax is clamped here before the scale is taken: an all-zero tensor gets a finite scale (and quantizes to zeros).
_MIN_AMAX = 2.0 ** -60


def po2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The e4m3 scale of a tensor whose largest magnitude is ``amax`` (fp32): ``2 ** floor(log2(448 / amax))``,
    exactly: from amax's exponent and mantissa (``frexp``: amax = m * 2**E, m in [0.5, 1); 448 = 0.875 * 2**9), not
    from a rounded quotient or logarithm, which can land on the wrong side of a power of two."""
    mantissa, exponent = torch.frexp(amax.float().clamp(min=_MIN_AMAX))
    power = 9 - exponent - (mantissa > 0.875).to(exponent.dtype)
    return torch.ldexp(torch.ones_like(mantissa), power)


def quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape, floating) -> (e4m3 tensor of x's shape, contiguous; descale fp32[1]) with one scale for the
    whole tensor (module docstring). What `fp8_quant.quantize_qkv` computes on the GPU, bit for bit."""
    if not x.is_floating_point():
        raise ValueError(f"expected a floating-point tensor to quantize, got {x.dtype}")
    scale = po2_scale(x.detach().abs().amax())
    return (x.float() * scale).to(E4M3).contiguous(), (1.0 / scale).reshape(1)


def _e4m3_round(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 at ``scale`` and back, in fp32."""
    return (x * scale).to(E4M3).float() / scale


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    return t.float().transpose(1, 2)  # (B, S, H, D) -> (B, H, S, D)


def cudnn_fp8_emulation(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                        quantize_out: bool = True, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """cuDNN's FP8 forward (module docstring), emulated in fp32 from the unquantized q, k, v.

    q: (B, Sq, H, D); k, v: (B, Skv, H, D) -> (B, Sq, H, D) in q's dtype. quantize_out=False keeps O unrounded
    (what a kernel writing bf16 O would give). key_mask: bool (B | 1, Skv) or (B | 1, 1, 1, Skv), True for a key
    attended (cuDNN's padding mask over the kept keys); the scales still come from every key.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    (q8, dq), (k8, dk), (v8, dv) = (quantize_reference(t) for t in (q, k, v))
    qf, kf, vf = _heads_first(q8) * dq, _heads_first(k8) * dk, _heads_first(v8) * dv
    s = (qf @ kf.transpose(-1, -2)) * scale
    if key_mask is not None:
        s = s.masked_fill(~key_mask.reshape(key_mask.shape[0], 1, 1, k.shape[1]), float("-inf"))
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    o = (_e4m3_round(p, P_SCALE) @ vf) / p.sum(dim=-1, keepdim=True)
    if quantize_out:
        o = _e4m3_round(o, 0.5 / dv)
    return o.transpose(1, 2).to(q.dtype)


def _int8_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (B, H, S, D) fp32 -> x rounded to int8 per ``block`` rows (scale amax / 127, half away from zero), in fp32."""
    b, h, s, d = x.shape
    pad = -s % block
    xp = torch.nn.functional.pad(x, (0, 0, 0, pad)).view(b, h, (s + pad) // block, block, d)
    step = xp.abs().amax(dim=(-2, -1), keepdim=True) / 127.0
    step = torch.where(step > 0, step, torch.ones_like(step))
    scaled = xp / step
    rounded = torch.trunc(scaled + 0.5 * torch.sign(scaled)).clamp(-127, 127)
    return (rounded * step).view(b, h, s + pad, d)[:, :, :s]


def sage_emulation(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """SageAttention 1's forward (module docstring), emulated in fp32. Shapes as `cudnn_fp8_emulation`."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    qf, kf, vf = _heads_first(q), _heads_first(k), _heads_first(v)
    kf = kf - kf.mean(dim=2, keepdim=True)
    s = _int8_blocks(qf * scale, 128) @ _int8_blocks(kf, 64).transpose(-1, -2)
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    o = (p.half().float() @ vf.half().float()) / p.sum(dim=-1, keepdim=True)
    return o.transpose(1, 2).to(q.dtype)


def rel_l2(out: torch.Tensor, reference: torch.Tensor) -> float:
    """||out - reference|| / ||reference||, in fp32."""
    ref = reference.float()
    return float((out.float() - ref).norm() / ref.norm().clamp(min=1e-30))
