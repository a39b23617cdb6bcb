"""``expert_choice_moe``: the routed MoE of an expert-choice layer at world 1, with no host sync.

Expert choice (NucleusMoE): every expert takes exactly ``rows_per_expert = batch * capacity`` tokens, so
the expert-major layout's offsets ``[0, R, 2R, ...]`` follow from the shapes alone. Unlike the general EP
plan (``plan.build_ep_plan``, which reads the routed counts on the host), nothing here reads GPU data on
the host, and every size is a shape: the path runs eagerly, under ``torch.compile`` without a graph break
and inside CUDA graphs.

Dataflow: gather the chosen rows (expert-major, as the routing returns them); the expert MLP writes
``rows[i] = (mlp_e(x[token_idx[i]]) * gating[i]).to(dtype)``; a deterministic reduce adds each token's
rows to its shared-expert output in fp32 (``combine_reduce``: pairs sorted by token once on the device,
slot offsets by ``searchsorted`` over the sorted token ids). diffusers' layer scatter-adds instead, which
is non-deterministic on CUDA.

Paths (chosen by ``xstage_dit.schedule.moe``): "fused" (the persistent Triton kernel,
``fused.expert_mlp_rows``, CUDA or ``TRITON_INTERPRET=1``), "serial" (``F.grouped_mm`` baseline),
"reference" (fp32 per-expert matmuls, the CPU path).
"""

from __future__ import annotations

import torch

from xstage_dit.ops.moe.config import MoEKernelConfig
from xstage_dit.ops.moe.custom_ops import moe_combine_reduce_op, moe_expert_mlp_rows_op
from xstage_dit.ops.moe.fused import equal_expert_offsets, expert_mlp_rows_grouped
from xstage_dit.ops.moe.reference import combine_reduce_reference, expert_mlp_reference

__all__ = ["EXPERT_CHOICE_PATHS", "expert_choice_slots", "expert_choice_moe"]

EXPERT_CHOICE_PATHS = ("fused", "serial", "reference")


def expert_choice_slots(token_idx: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reduce's token-major view of the pairs, on the device: (slot_offsets int32 (num_tokens + 1,),
    slots int32 (n_pairs,)); token t's rows are ``slots[slot_offsets[t]:slot_offsets[t+1]]``, in pair order.

    token_idx: int64 (n_pairs,) token of each pair, values in [0, num_tokens). A stable sort keeps a token's
    pairs in expert order, so the fp32 sum runs in one fixed order (deterministic)."""
    sorted_tok, order = torch.sort(token_idx, stable=True)
    bounds = torch.arange(num_tokens + 1, device=token_idx.device, dtype=sorted_tok.dtype)
    return torch.searchsorted(sorted_tok, bounds, out_int32=True), order.to(torch.int32)


def expert_choice_moe(
    x: torch.Tensor,
    token_idx: torch.Tensor,
    gating: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    shared: torch.Tensor | None,
    *,
    rows_per_expert: int,
    path: str,
    lead: int = 0,
    config: MoEKernelConfig | None = None,
) -> torch.Tensor:
    """Routed expert-choice MoE of all tokens on one rank; returns (tokens, hidden) in x.dtype.

    x: (tokens, hidden); token_idx: int64 (E * rows_per_expert,) the chosen tokens, expert-major (expert e's
    rows are ``[e*R, (e+1)*R)``); gating: (E * R,) router weights (any float dtype; used in fp32);
    gate_up: (E, hidden, 2*inter); down: (E, inter, hidden); shared: (tokens, hidden) or None.
    path: "fused" | "serial" | "reference"; lead: the fused kernel's tile order (0 = wave by wave).
    ``out[t] = shared[t] + sum_{i: token_idx[i] = t} gating[i] * mlp_{i // R}(x[t])`` (fp32 sum, one rounding).
    Example: ``expert_choice_moe(x, idx, w, gu, dn, shared, rows_per_expert=256, path="fused", lead=2)``.
    """
    if path not in EXPERT_CHOICE_PATHS:
        raise ValueError(f"expected path in {EXPERT_CHOICE_PATHS} (chosen by xstage_dit.schedule.moe), got {path!r}")
    if x.dim() != 2:
        raise ValueError(f"expected x of shape (tokens, hidden), got {tuple(x.shape)}")
    if gate_up.dim() != 3:
        raise ValueError(f"expected gate_up (E, hidden, 2*inter), got {tuple(gate_up.shape)}")
    if isinstance(rows_per_expert, bool) or not isinstance(rows_per_expert, int) or rows_per_expert < 1:
        raise ValueError(f"expected rows_per_expert an int >= 1, got {rows_per_expert!r}")
    tokens, hidden = x.shape
    n = gate_up.shape[0] * rows_per_expert
    if token_idx.dtype != torch.int64 or tuple(token_idx.shape) != (n,):
        raise ValueError(f"expected token_idx int64 ({n},) (E x rows_per_expert), got {token_idx.dtype} {tuple(token_idx.shape)}")
    if tuple(gating.shape) != (n,) or not gating.is_floating_point():
        raise ValueError(f"expected gating float ({n},), got {gating.dtype} {tuple(gating.shape)}")
    if shared is not None and tuple(shared.shape) != (tokens, hidden):
        raise ValueError(f"expected shared of shape {(tokens, hidden)}, got {tuple(shared.shape)}")
    x_em = x.index_select(0, token_idx)
    weight = gating.float()
    slot_offsets, slots = expert_choice_slots(token_idx, tokens)
    if path == "reference":
        offsets = equal_expert_offsets(gate_up.shape[0], rows_per_expert)
        rows = (expert_mlp_reference(x_em, gate_up, down, offsets) * weight[:, None]).to(x.dtype)
        return combine_reduce_reference(rows, slot_offsets, slots, shared, x.dtype)
    if path == "serial":
        rows = expert_mlp_rows_grouped(x_em, gate_up, down, rows_per_expert, weight)
    else:
        rows = moe_expert_mlp_rows_op(x_em, gate_up, down, rows_per_expert, weight, lead=lead, config=config)
    return moe_combine_reduce_op(rows, slot_offsets, slots, shared.contiguous() if shared is not None else None)
