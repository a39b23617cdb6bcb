"""The EP plan: where every row goes, derived on every rank from the all-gathered count matrix.

Rank ``me`` of ``P`` owns experts ``[me*El, (me+1)*El)``, ``El = E / P``. From its own (token, expert,
weight) pairs and the counts ``C: (P, E)`` (pairs of rank ``s`` for expert ``e``) every rank derives every
offset without further communication: the send order (slot order, sorted by (expert, token)), the row of
each pair in the expert rank's expert-major layout (expert ``j`` block, then source rank, then token
order), and the source rank and slot each computed row is combined into.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["EPPlan", "build_ep_plan"]


@dataclass
class EPPlan:
    """Where every row goes, for rank ``rank`` of ``world_size`` (see the module docstring).

    Source side (this rank's pairs, in send order = slot order, sorted by (expert, token)):
      send_token_idx int64[n_send] local token of each pair; send_expert int64[n_send];
      send_weight fp32[n_send]; send_splits list[P]; push_dest_rank / push_dest_row int32[n_send]
      (the pair's row in the expert rank's expert-major layout); slot_offsets int32[tokens+1] and
      slots int32[n_send] (the slots of each token, token-major) for the combine-reduce.
    Expert side (rows this rank computes, expert-major):
      expert_offsets list[El+1]; recv_splits list[P]; em_from_recv int64[n_recv] (received order ->
      expert-major gather index); em_to_recv int64[n_recv] (inverse); combine_dest_rank /
      combine_dest_row int32[n_recv] (source rank and slot of each row).
    counts: int64 (P, E) on CPU.  capacity_recv / capacity_slots: max rows / slots over ranks.
    """

    rank: int
    world_size: int
    num_experts: int
    num_tokens: int
    counts: torch.Tensor
    send_token_idx: torch.Tensor
    send_expert: torch.Tensor
    send_weight: torch.Tensor
    send_splits: list[int]
    push_dest_rank: torch.Tensor
    push_dest_row: torch.Tensor
    slot_offsets: torch.Tensor
    slots: torch.Tensor
    expert_offsets: list[int]
    recv_splits: list[int]
    em_from_recv: torch.Tensor
    em_to_recv: torch.Tensor
    combine_dest_rank: torch.Tensor
    combine_dest_row: torch.Tensor
    capacity_recv: int
    capacity_slots: int

    @property
    def num_experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    @property
    def num_recv(self) -> int:
        return self.expert_offsets[-1]


def _excl_cumsum(t: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cumsum(t, dim=dim) - t


def build_ep_plan(
    token_idx: torch.Tensor,
    expert_idx: torch.Tensor,
    weight: torch.Tensor,
    counts: torch.Tensor,
    *,
    rank: int,
    num_tokens: int,
) -> EPPlan:
    """The plan of rank ``rank`` from its pairs and the all-gathered counts.

    token_idx, expert_idx: int64[n_pairs] (local token, global expert) of this rank's pairs.
    weight: [n_pairs] router weight (any float dtype; kept as fp32).
    counts: int (P, E), ``counts[s, e]`` = pairs of rank s for expert e (row ``rank`` must match the pairs).
    num_tokens: this rank's local token count (batch * seq_local).
    """
    if token_idx.shape != expert_idx.shape or token_idx.shape != weight.shape or token_idx.dim() != 1:
        raise ValueError(
            f"expected token_idx, expert_idx, weight of one shape (n_pairs,), got "
            f"{tuple(token_idx.shape)}, {tuple(expert_idx.shape)}, {tuple(weight.shape)}"
        )
    counts = counts.to("cpu", torch.int64)
    P, E = counts.shape
    if E % P:
        raise ValueError(f"expected num_experts divisible by world size, got {E} experts on {P} ranks")
    if not 0 <= rank < P:
        raise ValueError(f"expected 0 <= rank < {P}, got {rank}")
    mine = torch.bincount(expert_idx.to("cpu"), minlength=E)
    if mine.shape[0] != E or not torch.equal(mine, counts[rank]):
        raise ValueError(f"expected counts[{rank}] to match this rank's pairs, got {counts[rank].tolist()} vs {mine.tolist()}")
    return EPPlan(
        rank=rank,
        world_size=P,
        num_experts=E,
        num_tokens=num_tokens,
        counts=counts,
        **_source_side(token_idx, expert_idx, weight, counts, rank, num_tokens),
        **_expert_side(counts, rank, token_idx.device),
        capacity_recv=int(counts.reshape(P, P, E // P).sum((0, 2)).max()) if P else 0,
        capacity_slots=int(counts.sum(1).max()),
    )


def _source_side(token_idx: torch.Tensor, expert_idx: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                 rank: int, num_tokens: int) -> dict:
    """The `EPPlan` fields of this rank's pairs: send order sorted by (expert, token) (grouped by destination
    rank, slot = position), each pair's row on its expert rank, and the slots of each token."""
    P, E = counts.shape
    El = E // P
    device = token_idx.device
    key = expert_idx.to(torch.int64) * max(num_tokens, 1) + token_idx.to(torch.int64)
    order = torch.argsort(key, stable=True)
    send_token_idx = token_idx[order].to(torch.int64)
    send_expert = expert_idx[order].to(torch.int64)
    send_weight = weight[order].to(torch.float32)
    send_splits = counts[rank].reshape(P, El).sum(1).tolist()

    colsum = counts.sum(0)  # rows per expert over all sources
    colsum_prefix = _excl_cumsum(colsum, 0)  # (E,)
    rowprefix = _excl_cumsum(counts, 0)  # (P, E): rows of expert e from sources < s
    myprefix = _excl_cumsum(counts[rank], 0)  # (E,)
    dest = send_expert.to("cpu") // El
    i_e = torch.arange(send_expert.numel()) - myprefix[send_expert.to("cpu")]
    push_row = colsum_prefix[send_expert.to("cpu")] - colsum_prefix[dest * El] + rowprefix[rank][send_expert.to("cpu")] + i_e

    tok_order = torch.argsort(send_token_idx, stable=True)
    per_tok = torch.bincount(send_token_idx, minlength=num_tokens) if num_tokens else torch.zeros(0, dtype=torch.int64)
    slot_offsets = torch.zeros(num_tokens + 1, dtype=torch.int32, device=device)
    slot_offsets[1:] = torch.cumsum(per_tok, 0).to(torch.int32)
    return dict(send_token_idx=send_token_idx, send_expert=send_expert, send_weight=send_weight,
                send_splits=send_splits, push_dest_rank=dest.to(torch.int32).to(device),
                push_dest_row=push_row.to(torch.int32).to(device), slot_offsets=slot_offsets,
                slots=tok_order.to(torch.int32).to(device))


def _expert_side(counts: torch.Tensor, rank: int, device: torch.device) -> dict:
    """The `EPPlan` fields of the rows this rank computes: expert-major offsets, the received order's
    permutation to expert-major and back, and the source rank and slot each row is combined into."""
    P, E = counts.shape
    El = E // P
    Cm = counts[:, rank * El : (rank + 1) * El]  # (P, El)
    expert_offsets = [0] + torch.cumsum(Cm.sum(0), 0).tolist()
    recv_splits = Cm.sum(1).tolist()
    lens_sj = Cm.reshape(-1)  # received order: source-major, then expert, then token
    recv_block_start = _excl_cumsum(lens_sj, 0)
    em_block_start = _excl_cumsum(Cm.t().reshape(-1), 0).reshape(El, P).t().reshape(-1)  # (s, j) -> em start
    n_recv = int(lens_sj.sum())
    blk = torch.repeat_interleave(torch.arange(P * El), lens_sj)
    i_in_blk = torch.arange(n_recv) - recv_block_start[blk]
    em_pos = em_block_start[blk] + i_in_blk  # received row k lands at expert-major row em_pos[k]
    em_from_recv = torch.empty(n_recv, dtype=torch.int64)
    em_from_recv[em_pos] = torch.arange(n_recv)
    src = blk // El
    e_glob = rank * El + blk % El
    slot_on_src = _excl_cumsum(counts, 1)[src, e_glob] + i_in_blk
    combine_dest_rank = torch.empty(n_recv, dtype=torch.int32)
    combine_dest_row = torch.empty(n_recv, dtype=torch.int32)
    combine_dest_rank[em_pos] = src.to(torch.int32)
    combine_dest_row[em_pos] = slot_on_src.to(torch.int32)
    return dict(expert_offsets=expert_offsets, recv_splits=recv_splits, em_from_recv=em_from_recv.to(device),
                em_to_recv=em_pos.to(device), combine_dest_rank=combine_dest_rank.to(device),
                combine_dest_row=combine_dest_row.to(device))
