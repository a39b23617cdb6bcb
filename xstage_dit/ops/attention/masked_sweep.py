"""The kernel sweep's cases for world-1 attention calls with a key-padding mask, where FP8 attention is on.

Such a call (NucleusMoE's image queries over image + padded text keys) has two takers: torch's SDPA with the mask
(diffusers' own call; no 16-bit kernel of the op's takes a mask) and, compiled, cuDNN's FP8 kernel with per-sample key
lengths (``fp8_traced.cudnn_fp8_attention(key_mask=...)``). A mask slows torch's SDPA down where an unmasked shape
does not show it (NucleusMoE on an H100: 0.764 ms a masked call of 2 x 4,096 queries over 4,272 keys, where the
unmasked kernel ran 1 x 4,224 in 0.215 ms: ~375 against ~680 TFLOP/s; fp8/NOTES.md), so the choice is timed on masked
inputs, in a family of its own ("-masked"):

    "sdpa"                torch SDPA with a boolean key mask (B, 1, 1, S), as diffusers calls it
    "cudnn-fp8+compiled"  the compiled FP8 path with the same mask (its casts as passes of their own: an upper bound
                          of its cost inside a compiled block)

The mask drops the last ``S // MASKED_DIVISOR`` keys (a padded text's tail; the kernel's time depends on the keys
attended, not on which).
"""

from __future__ import annotations

import functools

import torch

from xstage_dit.schedule.attention_kernel import COMPILED_SUFFIX

__all__ = ["MASKED_DIVISOR", "masked_cases"]

MASKED_DIVISOR = 32


def masked_cases(b: int, s: int, h: int, d: int, dtype: torch.dtype, device, qk_bounded: bool = False) -> dict:
    """{"sdpa", "cudnn-fp8+compiled" (where cuDNN's FP8 kernel takes the shape)}: timing closures over q, k, v of
    (b, s, h, d) and a key mask keeping the first s - s // MASKED_DIVISOR keys. qk_bounded: q's and k's bounds handed
    in, as layers with ``features.qk_bounds`` run it."""
    import torch.nn.functional as F

    from xstage_dit.ops.attention.cudnn_fp8 import unavailable
    from xstage_dit.ops.attention.fp8_traced import cudnn_fp8_attention

    q, k, v = (torch.randn((b, s, h, d), dtype=dtype, device=device) for _ in range(3))
    mask = (torch.arange(s, device=device) < s - s // MASKED_DIVISOR).expand(b, s).contiguous()
    scale = d ** -0.5

    def sdpa(q=q, k=k, v=v, mask=mask[:, None, None, :]):
        F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                       scale=scale)

    fns = {"sdpa": sdpa}
    if unavailable(torch.device(device), d) is None:
        bounds = (q.abs().amax().float(), k.abs().amax().float()) if qk_bounded else None
        compiled = torch.compile(functools.partial(cudnn_fp8_attention, scale=scale), fullgraph=True, dynamic=False)
        fns["cudnn-fp8" + COMPILED_SUFFIX] = lambda: compiled(q, k, v, amax_bounds=bounds, key_mask=mask)
    return fns
