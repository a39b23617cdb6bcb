"""Dispatch and return of rows through the library All-to-All (the serial and reference paths), and the
count exchange every path starts with.

The fused path pushes rows through a symmetric-memory peer table instead (``fused.push_rows``): the
source knows every destination row from the counts, so rows land in expert-major order with no
permutation pass and no second size exchange. Collectives go through ``xstage_dit.comm.staged`` (gloo
with CUDA tensors is staged through the host).
"""

from __future__ import annotations

import torch

from xstage_dit.comm.staged import all_gather_list, all_to_all_rows
from xstage_dit.ops.moe.plan import EPPlan
from xstage_dit.ops.moe.reference import dispatch_reference

__all__ = ["gather_counts", "dispatch_rows", "return_rows"]


def gather_counts(expert_idx: torch.Tensor, num_experts: int, group) -> torch.Tensor:
    """The count matrix ``C: int64 (P, E)`` on the CPU: ``C[s, e]`` = pairs of rank ``s`` for expert ``e``.

    expert_idx: int64 (n_pairs,) global expert of each of this rank's pairs. Collective over ``group``.
    """
    mine = torch.bincount(expert_idx, minlength=num_experts)
    return torch.stack([p.cpu() for p in all_gather_list(mine, group)])


def dispatch_rows(x: torch.Tensor, plan: EPPlan, group) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's pairs to the experts' ranks: (rows (n_recv, hidden), router weights fp32 (n_recv,)),
    both in expert-major order. x: (tokens, hidden) local tokens."""
    recv = dispatch_reference(x, plan.send_token_idx, plan.send_splits, plan.recv_splits, group)
    recv_w = all_to_all_rows(plan.send_weight[:, None], plan.send_splits, plan.recv_splits, group)[:, 0]
    return recv[plan.em_from_recv], recv_w[plan.em_from_recv]


def return_rows(rows: torch.Tensor, plan: EPPlan, group) -> torch.Tensor:
    """Computed rows (n_recv, hidden) in expert-major order back to their sources, in slot order there."""
    return all_to_all_rows(rows[plan.em_to_recv], plan.recv_splits, plan.send_splits, group)
