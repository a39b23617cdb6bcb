"""A bound on |q| and |k| known before an attention call, read off the weights of the RMS norms that produce them.

FP8 attention scales q and k by a power of two taken from their largest magnitude (``ops.attention.fp8_reference``).
Measured per call, that is a reduction over the whole tensor before the cast can start: inside a compiled block it
costs two extra passes over q and k (FLUX.1-dev on an H100: cudnn-fp8 saved 1.9 ms of a 101.7 ms step where its
kernel alone would save ~6.8; benchmarks/results/fp8/NOTES.md). Where q and k come out of an RMS norm followed by
nothing but RoPE, a bound is known in advance:

    |x_i| <= sqrt(n) * max|w| (+ max|b|)      for y = RMSNorm_n(x) * w (+ b): the normed row has norm <= sqrt(n)

and RoPE (a rotation of pairs inside a row) keeps it (|x'_i| <= |(x_i, x_j)| <= the row's norm). A bound larger than
the true amax costs no accuracy: e4m3 has 3 mantissa bits in every binade, only values 2**-6 below the scaled
largest one turn subnormal (FLUX's per-head norm: bound sqrt(128) * max|w|, about 2-4x the amax of N(0, 1) rows).
The cast is clamped to e4m3's range, so rounding past the bound saturates instead of overflowing.

Which processors call attention on exactly norm(q) and norm(k) (then RoPE, concatenation): ``PROCESSOR_NORMS``, read
from diffusers 0.42's source. Any other processor, or a norm of another type, gets no bound (the per-call amax).

    norms = qk_norms(attention_module, processor)      # (q norms, k norms) or None, at ``parallelize`` time
    bq, bk = amax_bounds(norms, q.device)              # fp32 0-dim tensors, inside the traced forward
"""

from __future__ import annotations

import math

import torch

__all__ = ["PROCESSOR_NORMS", "amax_bound", "amax_bounds", "qk_norms"]

# processor class name -> (the attention module's q norms, its k norms), every one applied right before RoPE (or
# nothing) and the attention call; the text stream's (FLUX's and Qwen-Image's norm_added_*, HiDream's *_t) are
# concatenated with the image stream's. A name the module lacks is a stream it does not have (FLUX's and HiDream's
# single-stream blocks); one set to None is a stream left unnormed (diffusers' Attention with qk_norm=None): no bound.
PROCESSOR_NORMS = {
    "FluxAttnProcessor": (("norm_q", "norm_added_q"), ("norm_k", "norm_added_k")),
    "WanAttnProcessor": (("norm_q",), ("norm_k",)),
    "WanAttnProcessor2_0": (("norm_q",), ("norm_k",)),
    "QwenDoubleStreamAttnProcessor2_0": (("norm_q", "norm_added_q"), ("norm_k", "norm_added_k")),
    "HiDreamAttnProcessor": (("q_rms_norm", "q_rms_norm_t"), ("k_rms_norm", "k_rms_norm_t")),
    # image queries only; keys: the image's (norm_k) then the text's (norm_added_k, also what diffusers' text KV
    # cache hook applies to the keys it hands in as cached_txt_key)
    "NucleusMoEAttnProcessor2_0": (("norm_q",), ("norm_k", "norm_added_k")),
}
_ABSENT = object()


def _rms_norm_size(norm: torch.nn.Module) -> int | None:
    """The number of elements one RMS norm normalizes over, or None where ``norm`` is not an RMS norm known here."""
    from diffusers.models.normalization import RMSNorm

    if isinstance(norm, torch.nn.RMSNorm):
        return math.prod(norm.normalized_shape)
    if isinstance(norm, RMSNorm):
        return math.prod(norm.dim)
    return None


def qk_norms(module: torch.nn.Module, processor) -> tuple[tuple, tuple] | None:
    """(q norms, k norms) of ``module`` whose weights bound q and k at ``processor``'s attention call, or None (the
    processor is not one of ``PROCESSOR_NORMS``, or a norm is missing or not an RMS norm)."""
    names = PROCESSOR_NORMS.get(type(processor).__name__)
    if names is None or not type(processor).__module__.startswith("diffusers."):
        return None  # another class, or a user's of the same name: it may do anything between the norm and SDPA
    found = []
    for group in names:
        norms = tuple(m for m in (getattr(module, n, _ABSENT) for n in group) if m is not _ABSENT)
        if not norms or any(m is None or _rms_norm_size(m) is None for m in norms):
            return None
        found.append(norms)
    return found[0], found[1]


def amax_bound(norms: tuple, device: torch.device | str | None = None) -> torch.Tensor:
    """max over ``norms`` of sqrt(n) * max|weight| (+ max|bias|) (sqrt(n) where a norm has no weight): an fp32 0-dim
    tensor on ``device`` (default: the CPU). Traceable: the weights enter a compiled graph as inputs."""
    bounds = []
    for norm in norms:
        root_n = math.sqrt(_rms_norm_size(norm))
        weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
        bound = (torch.full((), root_n, device=device) if weight is None
                 else weight.detach().float().abs().amax().to(device) * root_n)
        if bias is not None:
            bound = bound + bias.detach().float().abs().amax()
        bounds.append(bound)
    return torch.stack(bounds).amax() if len(bounds) > 1 else bounds[0]


def amax_bounds(norms: tuple[tuple, tuple], device: torch.device | str | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(bound on |q|, bound on |k|) of `qk_norms`' answer, on ``device``."""
    return amax_bound(norms[0], device), amax_bound(norms[1], device)
