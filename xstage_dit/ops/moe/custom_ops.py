"""The MoE fast ops as torch custom ops (``torch.library.custom_op`` + ``register_fake``), registered once.

Registered here, so that ``torch.compile`` traces them as single ops and CUDA graphs see them.

``xstage_dit::moe_combine_reduce(buf, slot_offsets, slots, shared) -> (tokens, hidden)`` and
``xstage_dit::moe_expert_mlp_combine(x, gate_up, down, expert_offsets, row_weight, dest_rank, dest_row,
combine_table, combine_buffer, lead) -> ()`` and ``xstage_dit::moe_expert_mlp_rows(x, gate_up, down,
rows_per_expert, row_weight, lead, config) -> (rows, hidden)``; arguments as ``fused.combine_reduce``,
``fused.expert_mlp_combine`` and ``fused.expert_mlp_rows`` (``config`` as ``config_to_ints``). Imported by ``xstage_dit.ops.moe`` (the package), so the ops exist as soon
as the MoE fast path does.
"""

from __future__ import annotations

import torch

from xstage_dit.ops.moe.config import MoEKernelConfig, config_from_ints, config_to_ints
from xstage_dit.ops.moe.fused import combine_reduce, expert_mlp_combine, expert_mlp_rows

__all__ = ["NAMESPACE", "moe_combine_reduce_op", "moe_expert_mlp_combine_op", "moe_expert_mlp_rows_op"]

NAMESPACE = "xstage_dit"


@torch.library.custom_op(f"{NAMESPACE}::moe_combine_reduce", mutates_args=())
def _moe_combine_reduce(buf: torch.Tensor, slot_offsets: torch.Tensor, slots: torch.Tensor,
                        shared: torch.Tensor | None) -> torch.Tensor:
    return combine_reduce(buf, slot_offsets, slots, shared, buf.dtype)


@_moe_combine_reduce.register_fake
def _(buf, slot_offsets, slots, shared):
    return buf.new_empty(slot_offsets.shape[0] - 1, buf.shape[1])


@torch.library.custom_op(f"{NAMESPACE}::moe_expert_mlp_combine", mutates_args=("combine_buffer",))
def _moe_expert_mlp_combine(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_offsets: list[int],
                            row_weight: torch.Tensor, dest_rank: torch.Tensor, dest_row: torch.Tensor,
                            combine_table: torch.Tensor, combine_buffer: torch.Tensor, lead: int) -> None:
    # combine_buffer: this rank's own combine buffer (one entry of the table), declared mutated so that a
    # compiled graph orders the combine-reduce after this op; peers' writes are ordered by the barrier.
    expert_mlp_combine(x, gate_up, down, expert_offsets, row_weight, dest_rank, dest_row, combine_table, lead=lead)


@_moe_expert_mlp_combine.register_fake
def _(x, gate_up, down, expert_offsets, row_weight, dest_rank, dest_row, combine_table, combine_buffer, lead):
    return None


@torch.library.custom_op(f"{NAMESPACE}::moe_expert_mlp_rows", mutates_args=())
def _moe_expert_mlp_rows(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, rows_per_expert: int,
                         row_weight: torch.Tensor, lead: int, config: list[int]) -> torch.Tensor:
    return expert_mlp_rows(x, gate_up, down, rows_per_expert, row_weight, lead=lead, config=config_from_ints(config))


@_moe_expert_mlp_rows.register_fake
def _(x, gate_up, down, rows_per_expert, row_weight, lead, config):
    return x.new_empty(x.shape[0], x.shape[1])


def moe_combine_reduce_op(buf, slot_offsets, slots, shared=None) -> torch.Tensor:
    """``torch.ops.xstage_dit.moe_combine_reduce``: buf (>= slots, hidden), slot_offsets int32 (tokens + 1,),
    slots int32 (slots,), shared (tokens, hidden) or None -> (tokens, hidden) in buf.dtype."""
    return torch.ops.xstage_dit.moe_combine_reduce(buf, slot_offsets, slots, shared)


def moe_expert_mlp_combine_op(x, gate_up, down, expert_offsets, row_weight, dest_rank, dest_row, combine_table,
                              combine_buffer, *, lead: int) -> None:
    """``torch.ops.xstage_dit.moe_expert_mlp_combine`` (arguments as ``expert_mlp_combine``; ``lead`` >= 0,
    the schedule's choice: the op does not choose it)."""
    if isinstance(lead, bool) or not isinstance(lead, int) or lead < 0:
        raise ValueError(f"expected lead an int >= 0 (0 = wave-by-wave), got {lead!r}")
    torch.ops.xstage_dit.moe_expert_mlp_combine(x, gate_up, down, [int(v) for v in expert_offsets], row_weight,
                                                dest_rank, dest_row, combine_table, combine_buffer, lead)


def moe_expert_mlp_rows_op(x, gate_up, down, rows_per_expert: int, row_weight, *, lead: int,
                           config: MoEKernelConfig | None = None) -> torch.Tensor:
    """``torch.ops.xstage_dit.moe_expert_mlp_rows``: x (E_local * rows_per_expert, hidden) expert-major, row_weight
    fp32 (rows,) -> (rows, hidden) weighted expert rows in x.dtype (``fused.expert_mlp_rows``); ``lead`` >= 0."""
    if isinstance(lead, bool) or not isinstance(lead, int) or lead < 0:
        raise ValueError(f"expected lead an int >= 0 (0 = wave-by-wave), got {lead!r}")
    return torch.ops.xstage_dit.moe_expert_mlp_rows(x, gate_up, down, int(rows_per_expert), row_weight, lead,
                                                    config_to_ints(config))
