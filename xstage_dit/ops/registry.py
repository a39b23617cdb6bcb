"""The one place where fast ops become torch custom ops (``torch.library.custom_op`` + ``register_fake``),
so that ``torch.compile`` can trace a patched model and CUDA graphs see a single op.

To add an op: write its eager implementation in its own module, then here a ``custom_op`` wrapper
taking only tensors and plain values, its fake (shape/dtype only), and a thin public caller.
Process groups cannot cross the op boundary, so callers pass ``group_name(group)`` and the wrapper
resolves it with ``resolve_group``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

NAMESPACE = "xstage_dit"

_GROUPS: dict[str, dist.ProcessGroup] = {}


def group_name(group: dist.ProcessGroup | None) -> str:
    """A string naming `group` inside a custom op ("" = no group / the default world group)."""
    if group is None:
        return ""
    name = group.group_name
    _GROUPS[name] = group
    return name


def resolve_group(name: str) -> dist.ProcessGroup | None:
    """Inverse of ``group_name``."""
    if not name:
        return None
    try:
        return _GROUPS[name]
    except KeyError:
        raise ValueError(f"expected a process group registered through group_name(), got unknown name {name!r}") from None


# ------------------------------------------------------------------------------- ulysses_attention


@torch.library.custom_op(f"{NAMESPACE}::ulysses_attention", mutates_args=())
def _ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: str, schedule: str,
                       scale: float | None, seq_len: int | None) -> torch.Tensor:
    from xstage_dit.ops.attention.op import ulysses_attention_impl

    return ulysses_attention_impl(q, k, v, group=resolve_group(group), schedule=schedule, scale=scale, seq_len=seq_len)


@_ulysses_attention.register_fake
def _(q, k, v, group, schedule, scale, seq_len):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def ulysses_attention_op(q, k, v, *, group=None, schedule="auto", scale=None, seq_len=None) -> torch.Tensor:
    """Call ``xstage_dit::ulysses_attention`` (arguments as ``ops.ulysses_attention.ulysses_attention``)."""
    return torch.ops.xstage_dit.ulysses_attention(q, k, v, group_name(group), schedule,
                                                  None if scale is None else float(scale), seq_len)


# ------------------------------------------------------------------------------- MoE expert MLP + combine


@torch.library.custom_op(f"{NAMESPACE}::moe_combine_reduce", mutates_args=())
def _moe_combine_reduce_op(buf: torch.Tensor, slot_offsets: torch.Tensor, slots: torch.Tensor,
                           shared: torch.Tensor | None) -> torch.Tensor:
    from xstage_dit.ops.moe.combine import combine_reduce

    return combine_reduce(buf, slot_offsets, slots, shared, buf.dtype)


@_moe_combine_reduce_op.register_fake
def _(buf, slot_offsets, slots, shared):
    return buf.new_empty(slot_offsets.shape[0] - 1, buf.shape[1])


@torch.library.custom_op(f"{NAMESPACE}::moe_expert_mlp_combine", mutates_args=("combine_buffer",))
def _moe_expert_mlp_combine_op(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_offsets: list[int],
                               row_weight: torch.Tensor, dest_rank: torch.Tensor, dest_row: torch.Tensor,
                               combine_table: torch.Tensor, combine_buffer: torch.Tensor, lead: int) -> None:
    # combine_buffer: this rank's own combine buffer (one entry of the table), declared mutated so that a
    # compiled graph orders the combine-reduce after this op; peers' writes are ordered by the barrier.
    from xstage_dit.ops.moe.combine import expert_mlp_combine

    expert_mlp_combine(x, gate_up, down, expert_offsets, row_weight, dest_rank, dest_row, combine_table,
                       lead=None if lead < 0 else lead)


@_moe_expert_mlp_combine_op.register_fake
def _(x, gate_up, down, expert_offsets, row_weight, dest_rank, dest_row, combine_table, combine_buffer, lead):
    return None


def moe_combine_reduce_op(buf, slot_offsets, slots, shared=None) -> torch.Tensor:
    """``torch.ops.xstage_dit.moe_combine_reduce`` (arguments as ``combine_reduce``, output in buf.dtype)."""
    return torch.ops.xstage_dit.moe_combine_reduce(buf, slot_offsets, slots, shared)


def moe_expert_mlp_combine_op(x, gate_up, down, expert_offsets, row_weight, dest_rank, dest_row, combine_table,
                              combine_buffer, *, lead: int | None = None) -> None:
    """``torch.ops.xstage_dit.moe_expert_mlp_combine`` (arguments as ``expert_mlp_combine``; lead None = chosen)."""
    torch.ops.xstage_dit.moe_expert_mlp_combine(x, gate_up, down, [int(v) for v in expert_offsets], row_weight,
                                                dest_rank, dest_row, combine_table, combine_buffer,
                                                -1 if lead is None else int(lead))
