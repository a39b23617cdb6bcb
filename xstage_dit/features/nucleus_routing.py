"""NucleusMoE's expert-choice routing, as diffusers' ``NucleusMoELayer`` computes it, for the EP layers.

``nucleus_routing(affinity, capacity_factor, route_scale)``: every expert takes its top-C tokens of each
batch row over the whole sequence; each chosen pair's gate is its score over the token's summed scores.
The sums are the one place where the device matters (``token_score_sums``): diffusers' scatter-add is
atomic on CUDA, so its order and a gate's last bit changed between two H200 runs; there a fixed-order sum
over a dense table replaces it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["nucleus_routing", "token_score_sums"]


def token_score_sums(gating: torch.Tensor, top_indices: torch.Tensor, flat_idx: torch.Tensor,
                     gating_flat: torch.Tensor, slen: int, *, dense: bool | None = None) -> torch.Tensor:
    """Each token's sum of the gating scores of the experts that chose it: (B * S,) in gating.dtype.

    gating, top_indices: (B, E, C), expert e's top-C tokens of batch row b (distinct within a row);
    flat_idx, gating_flat: the same pairs flattened expert-major (``b * S + s`` and the score).
    On the CPU, diffusers' own ``scatter_add_`` over the flat pairs (one add at a time in pair order:
    bit-equal to the unsharded layer). On CUDA that scatter-add is atomic, so its fp order, and the last bit
    of a gate, changes from run to run (seen on the H200: two calls of the fused world-1 layer differed);
    there the scores go into a dense (B, E, S) table with a plain scatter (indices are distinct per row, so
    no two writes meet) and are summed over experts, a fixed-order reduction: every run and every rank agree.
    dense: force the table form (True) or the scatter-add (False); None picks by device as above.
    """
    bs, experts, _ = gating.shape
    if not (gating.device.type == "cuda" if dense is None else dense):
        sums = torch.zeros(bs * slen, device=gating.device, dtype=gating.dtype)
        return sums.scatter_add_(0, flat_idx, gating_flat)
    table = gating.new_zeros(bs, experts, slen).scatter_(-1, top_indices, gating)
    return table.sum(dim=1).reshape(-1)


def nucleus_routing(affinity: torch.Tensor, capacity_factor: float, route_scale: float):
    """diffusers' NucleusMoELayer expert-choice routing on the full-sequence affinity (same ops, same order).

    affinity: (B, E, S) scores. Returns (global_token_indices int64[E*B*C], gating_flat [E*B*C] in
    affinity.dtype, capacity C); pair order is expert-major, then batch, then choice.
    """
    bs, E, slen = affinity.shape
    capacity = max(1, math.ceil(capacity_factor * slen / E))
    topk = torch.topk(affinity, k=capacity, dim=-1)
    top_indices = topk.indices
    gating = affinity.gather(dim=-1, index=top_indices)
    batch_offsets = torch.arange(bs, device=affinity.device, dtype=torch.long).view(bs, 1, 1) * slen
    global_token_indices = (batch_offsets + top_indices).transpose(0, 1).reshape(E, -1).reshape(-1)
    gating_flat = gating.transpose(0, 1).reshape(E, -1).reshape(-1)
    sums = token_score_sums(gating, top_indices, global_token_indices, gating_flat, slen)
    gating_flat = gating_flat / (sums[global_token_indices] + 1e-12)
    gating_flat = gating_flat * route_scale
    return global_token_indices, gating_flat, capacity
