"""A key-padding mask as per-sample key lengths: the form cuDNN's padding mask takes (``cudnn_fp8``, ``cudnn_padded``).

    k2, v2, lengths = kept_keys_first(k, v, key_mask)   # attend k2[b, :lengths[b]] = the keys key_mask[b] keeps
"""

from __future__ import annotations

import torch

__all__ = ["kept_keys_first"]


def kept_keys_first(k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v (B, Skv, H, D) and a key-padding mask (bool, True keeps: (B | 1, Skv) or (B | 1, 1, 1, Skv)) ->
    (k, v with each batch element's kept keys first, in their order, then the others; int32 (B,) kept counts).

    Attention is the same over any order of its keys, so attending the first count keys of the reordered k, v is
    attending the kept keys: cuDNN's padding mask (per-sample key lengths) then takes any key-padding mask, not only
    right-padded ones, with no host read. Compiled, the gather is a load through an index that Inductor folds into
    the kernels that write k and v (their RoPE, concatenation, FP8 casts)."""
    b, skv = k.shape[:2]
    if (key_mask.dtype != torch.bool or key_mask.dim() not in (2, 4) or key_mask.shape[-1] != skv
            or key_mask.shape[0] not in (1, b) or (key_mask.dim() == 4 and key_mask.shape[1:3] != (1, 1))):
        raise ValueError(f"expected a bool key mask (B | 1, Skv) or (B | 1, 1, 1, Skv) with B={b}, Skv={skv}, got "
                         f"{key_mask.dtype} {tuple(key_mask.shape)}")
    keep = key_mask.reshape(key_mask.shape[0], skv).expand(b, skv)
    order = torch.argsort(keep.logical_not().to(torch.int8), dim=1, stable=True)  # kept (0) first, stable
    index = order[:, :, None, None].expand(k.shape)
    return k.gather(1, index), v.gather(1, index), keep.sum(dim=1, dtype=torch.int32)
