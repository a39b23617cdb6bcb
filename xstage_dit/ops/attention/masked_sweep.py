"""The kernel sweep's cases for world-1 attention calls with a key-padding mask (its "-masked" families).

Such a call (NucleusMoE's image queries over image + padded text keys, CFG's batched pair) is taken by torch's SDPA
with the mask (diffusers' own call; no kernel of the op's window path takes a mask) or by cuDNN's padding mask over
per-sample key lengths: in 16 bits (``cudnn_padded``) and, compiled with FP8 attention on, in FP8
(``fp8_traced.cudnn_fp8_attention(key_mask=...)``). A mask slows torch's SDPA down where an unmasked shape does not
show it (NucleusMoE on an H100: 0.764 ms a masked call of 2 x 4,096 queries over 4,272 keys, where the unmasked kernel
ran 1 x 4,224 in 0.215 ms: ~375 against ~680 TFLOP/s; fp8/NOTES.md), so the choice is timed on masked inputs:

    "sdpa"                torch SDPA with a boolean key mask (B, 1, 1, S), as diffusers calls it
    "cudnn-padded"        ``cudnn_padded_attention`` eagerly (its key gather a pass of its own: compiled, it folds)
    "cudnn-fp8+compiled"  (fp8) the compiled FP8 path with the same mask (its casts as passes of their own: an upper
                          bound of its cost inside a compiled block)

The mask drops the last ``S // MASKED_DIVISOR`` keys (a padded text's tail; a kernel's time depends on the keys
attended, not on which).
"""

from __future__ import annotations

import functools

import torch

from xstage_dit.schedule.attention_kernel import COMPILED_SUFFIX

__all__ = ["MASKED_DIVISOR", "masked_cases"]

MASKED_DIVISOR = 32


def masked_cases(b: int, s: int, h: int, d: int, dtype: torch.dtype, device, *, fp8: bool = False,
                 qk_bounded: bool = False) -> dict:
    """{"sdpa", "cudnn-padded", "cudnn-fp8+compiled" (fp8)}, each where its kernel takes the shape: timing closures
    over q, k, v of (b, s, h, d) and a key mask keeping the first s - s // MASKED_DIVISOR keys. qk_bounded: q's and
    k's bounds handed to the FP8 path, as layers with ``features.qk_bounds`` run it."""
    import torch.nn.functional as F

    from xstage_dit.ops.attention import cudnn_padded
    from xstage_dit.ops.attention.cudnn_fp8 import unavailable as fp8_unavailable
    from xstage_dit.ops.attention.fp8_traced import cudnn_fp8_attention

    q, k, v = (torch.randn((b, s, h, d), dtype=dtype, device=device) for _ in range(3))
    mask = (torch.arange(s, device=device) < s - s // MASKED_DIVISOR).expand(b, s).contiguous()
    scale = d ** -0.5

    def sdpa(q=q, k=k, v=v, mask=mask[:, None, None, :]):
        F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                       scale=scale)

    fns = {"sdpa": sdpa}
    if cudnn_padded.unavailable(torch.device(device), d, dtype) is None:
        fns["cudnn-padded"] = lambda: cudnn_padded.cudnn_padded_attention(q, k, v, mask, scale=scale)
    if fp8 and fp8_unavailable(torch.device(device), d) is None:
        bounds = (q.abs().amax().float(), k.abs().amax().float()) if qk_bounded else None
        compiled = torch.compile(functools.partial(cudnn_fp8_attention, scale=scale), fullgraph=True, dynamic=False)
        fns["cudnn-fp8" + COMPILED_SUFFIX] = lambda: compiled(q, k, v, amax_bounds=bounds, key_mask=mask)
    return fns
