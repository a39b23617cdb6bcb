"""``ep_moe_forward``: the expert-parallel routed MoE of one rank, on the path and lead it is handed.

Paths (chosen by ``xstage_dit.schedule.moe``, never here):

- "fused" (CUDA): push dispatch through a symmetric-memory peer table, the persistent expert kernel whose
  Linear-2 epilogue stores each combine row into its source rank's buffer, then the combine-reduce;
- "serial": library All-to-All both ways around the unfused grouped-matmul MLP (the baseline);
- "reference": library All-to-All around the fp32 reference MLP (the CPU path).
"""

from __future__ import annotations

import torch

from xstage_dit.comm.buffers import symmetric_buffer
from xstage_dit.comm.distributed import world_of
from xstage_dit.ops.moe.config import MoEKernelConfig
from xstage_dit.ops.moe.dispatch import dispatch_rows, gather_counts, return_rows
from xstage_dit.ops.moe.fused import combine_reduce, expert_mlp_combine, expert_mlp_combine_grouped, next_pow2, push_rows
from xstage_dit.ops.moe.plan import build_ep_plan
from xstage_dit.ops.moe.reference import combine_reduce_reference, expert_mlp_reference

__all__ = ["EP_RUN_PATHS", "ep_moe_forward"]

EP_RUN_PATHS = ("fused", "serial", "reference")


def ep_moe_forward(
    x: torch.Tensor,
    token_idx: torch.Tensor,
    expert_idx: torch.Tensor,
    weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    shared: torch.Tensor | None,
    *,
    num_experts: int,
    path: str,
    lead: int,
    group=None,
    config: MoEKernelConfig | None = None,
) -> torch.Tensor:
    """Expert-parallel routed MoE on this rank's tokens; returns (tokens, hidden) in x.dtype.

    x: (tokens, hidden) local tokens; token_idx, expert_idx: int64 (n_pairs,) and weight (n_pairs,): this
    rank's pairs (local token, global expert, router weight); gate_up: (E_local, hidden, 2*inter) and
    down: (E_local, inter, hidden): this rank's experts; shared: (tokens, hidden) added in the reduce,
    or None. path: "fused" | "serial" | "reference"; lead: the fused kernel's tile order (0 = wave by
    wave, D >= 1 interleaved; unused by the other paths). Collective over ``group``.
    ``out[t] = shared[t] + sum_pairs(t) w * expert_mlp(x[t])``.
    """
    if path not in EP_RUN_PATHS:
        raise ValueError(f"expected path in {EP_RUN_PATHS} (chosen by xstage_dit.schedule.moe), got {path!r}")
    if path == "fused" and x.device.type != "cuda":
        raise RuntimeError(f"path='fused' needs CUDA tensors, got {x.device}")
    rank, _ = world_of(group)
    tokens, H = x.shape
    counts = gather_counts(expert_idx, num_experts, group)
    plan = build_ep_plan(token_idx, expert_idx, weight, counts, rank=rank, num_tokens=tokens)
    if path in ("reference", "serial"):
        x_em, w_em = dispatch_rows(x, plan, group)
        if path == "reference":
            rows = (expert_mlp_reference(x_em, gate_up, down, plan.expert_offsets) * w_em[:, None]).to(x.dtype)
        else:
            rows = torch.empty_like(x_em)
            expert_mlp_combine_grouped(x_em, gate_up, down, plan.expert_offsets, w_em, torch.zeros_like(plan.combine_dest_rank),
                                       torch.arange(x_em.shape[0], device=x.device, dtype=torch.int32), [rows])  # fmt: skip
        buf = return_rows(rows, plan, group)
        if path == "reference":
            return combine_reduce_reference(buf, plan.slot_offsets, plan.slots, shared, x.dtype)
        return combine_reduce(buf, plan.slot_offsets, plan.slots, shared.contiguous() if shared is not None else None, x.dtype)

    # Fused: push dispatch, persistent expert kernel with remote combine, reduce.
    x = x.contiguous()
    cap_recv = next_pow2(max(1, plan.capacity_recv))
    cap_slots = next_pow2(max(1, plan.capacity_slots))
    recv_x = symmetric_buffer("moe.recv_x", (cap_recv, H), x.dtype, x.device, group)
    recv_w = symmetric_buffer("moe.recv_w", (cap_recv, 1), torch.float32, x.device, group)
    comb = symmetric_buffer("moe.combine", (cap_slots, H), x.dtype, x.device, group)
    push_rows(x, plan.send_token_idx.to(torch.int32), recv_x.ptr_table, plan.push_dest_rank, plan.push_dest_row)
    push_rows(plan.send_weight[:, None].contiguous(), torch.arange(plan.send_weight.shape[0], device=x.device, dtype=torch.int32),
              recv_w.ptr_table, plan.push_dest_rank, plan.push_dest_row)  # fmt: skip
    recv_x.barrier()
    n = plan.num_recv
    expert_mlp_combine(
        recv_x.tensor[:n], gate_up, down, plan.expert_offsets, recv_w.tensor[:n, 0].contiguous(),
        plan.combine_dest_rank, plan.combine_dest_row, comb.ptr_table, config=config, lead=lead,
    )  # fmt: skip
    comb.barrier()
    out = combine_reduce(comb.tensor, plan.slot_offsets, plan.slots, shared, x.dtype)
    # Nobody may push the next layer's rows into buffers a peer is still reading.
    comb.barrier()
    return out
