"""Pure-torch references of the MoE ops: they define the semantics, tests and the CPU path call them.

Each computes in fp32 and rounds where the kernel rounds (the SwiGLU output and the weighted combine row
are rounded to the activation dtype). Fast paths: ``xstage_dit.ops.moe.fused`` (the expert MLP with
remote combine, the row push, the combine-reduce).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from xstage_dit.comm.staged import all_to_all_rows

__all__ = [
    "check_expert_inputs",
    "check_combine_args",
    "expert_mlp_reference",
    "expert_mlp_combine_reference",
    "combine_reduce_reference",
    "dispatch_reference",
]


def check_expert_inputs(x, gate_up, down, expert_offsets) -> tuple[int, int, int]:
    """(E_local, hidden, inter) of the expert-MLP operands, or ValueError naming the first bad one."""
    if x.dim() != 2:
        raise ValueError(f"expected x of shape (rows, hidden), got {tuple(x.shape)}")
    if gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(
            f"expected gate_up (E_local, hidden, 2*inter) and down (E_local, inter, hidden), got "
            f"{tuple(gate_up.shape)} and {tuple(down.shape)}"
        )
    El, H, I2 = gate_up.shape
    if H != x.shape[1]:
        raise ValueError(f"expected gate_up hidden {x.shape[1]} (x.shape[1]), got {H}")
    if I2 % 2:
        raise ValueError(f"expected gate_up last dim even (gate and up), got {I2}")
    I = I2 // 2
    if tuple(down.shape) != (El, I, H):
        raise ValueError(f"expected down of shape {(El, I, H)}, got {tuple(down.shape)}")
    offs = list(expert_offsets)
    if len(offs) != El + 1 or offs[0] != 0 or offs[-1] != x.shape[0] or any(b < a for a, b in zip(offs, offs[1:])):
        raise ValueError(
            f"expected {El + 1} non-decreasing expert offsets from 0 to {x.shape[0]} (rows), got {offs}"
        )
    return El, H, I


def expert_mlp_reference(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_offsets: Sequence[int]
) -> torch.Tensor:
    """Per-expert SwiGLU MLP in fp32, SwiGLU output rounded to ``x.dtype`` (as the kernel stores it).

    x: (rows, hidden) expert-major; gate_up: (E_local, hidden, 2*inter) (gate columns first);
    down: (E_local, inter, hidden); expert_offsets: E_local + 1 row offsets. Returns fp32 (rows, hidden).
    ``y = (silu(x @ Wg) * (x @ Wu)).to(x.dtype) @ W2``.
    """
    El, H, I = check_expert_inputs(x, gate_up, down, expert_offsets)
    y = torch.zeros(x.shape[0], H, dtype=torch.float32, device=x.device)
    for e in range(El):
        a, b = int(expert_offsets[e]), int(expert_offsets[e + 1])
        if a == b:
            continue
        gu = x[a:b].float() @ gate_up[e].float()
        h = (F.silu(gu[:, :I]) * gu[:, I:]).to(x.dtype).float()
        y[a:b] = h @ down[e].float()
    return y


def check_combine_args(x, row_weight, dest_rank, dest_row) -> None:
    """One router weight, destination rank and destination row per row of x, on x's device."""
    n = x.shape[0]
    for name, t in (("row_weight", row_weight), ("dest_rank", dest_rank), ("dest_row", dest_row)):
        if t.dim() != 1 or t.shape[0] != n:
            raise ValueError(f"expected {name} of shape ({n},), got {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"expected {name} on {x.device}, got {t.device}")


def expert_mlp_combine_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    expert_offsets: Sequence[int],
    row_weight: torch.Tensor,
    dest_rank: torch.Tensor,
    dest_row: torch.Tensor,
    combine_buffers: Sequence[torch.Tensor],
) -> None:
    """Reference of ``expert_mlp_combine``: ``combine_buffers[dest_rank[i]][dest_row[i]] = (y[i] * w[i]).to(dtype)``.

    combine_buffers: one (slots, hidden) tensor per rank (dtype of x). Rows not addressed are untouched.
    """
    check_combine_args(x, row_weight, dest_rank, dest_row)
    y = expert_mlp_reference(x, gate_up, down, expert_offsets)
    rows = (y * row_weight.float()[:, None]).to(x.dtype)
    for r, buf in enumerate(combine_buffers):
        sel = (dest_rank == r).nonzero().flatten()
        if sel.numel():
            buf[dest_row[sel].long()] = rows[sel].to(buf.device)


def combine_reduce_reference(
    buf: torch.Tensor, slot_offsets: torch.Tensor, slots: torch.Tensor, shared: torch.Tensor | None, out_dtype=None
) -> torch.Tensor:
    """``out[t] = shared[t] + sum(buf[slots[j]] for j in [slot_offsets[t], slot_offsets[t+1]))`` in fp32.

    buf: (>= num_slots, hidden); slot_offsets: int (tokens + 1,); slots: int (num_slots,);
    shared: (tokens, hidden) or None. Returns (tokens, hidden) in out_dtype (default buf.dtype).
    """
    tokens = slot_offsets.shape[0] - 1
    out = torch.zeros(tokens, buf.shape[1], dtype=torch.float32, device=buf.device)
    if shared is not None:
        if tuple(shared.shape) != (tokens, buf.shape[1]):
            raise ValueError(f"expected shared of shape {(tokens, buf.shape[1])}, got {tuple(shared.shape)}")
        out += shared.float()
    counts = (slot_offsets[1:] - slot_offsets[:-1]).long()
    # output_size: the slots' count is a shape, so no host read of the counts (no sync, traceable).
    tok_of_slot = torch.repeat_interleave(torch.arange(tokens, device=buf.device), counts, output_size=slots.shape[0])
    out.index_add_(0, tok_of_slot, buf[slots.long()].float())
    return out.to(out_dtype or buf.dtype)


def dispatch_reference(
    x: torch.Tensor, send_token_idx: torch.Tensor, send_splits: list[int], recv_splits: list[int], group=None
) -> torch.Tensor:
    """Library All-to-All of the rows ``x[send_token_idx]`` (received order: source-major).

    x: (tokens, C); returns (sum(recv_splits), C). World 1: a gather.
    """
    return all_to_all_rows(x[send_token_idx], send_splits, recv_splits, group)
