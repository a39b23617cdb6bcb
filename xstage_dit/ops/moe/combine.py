"""Expert-parallel MoE: dispatch, fused expert MLP with remote Combine, combine-reduce; EP layers.

Data flow on each of ``P`` ranks (rank ``me`` owns experts ``[me*El, (me+1)*El)``, ``El = E / P``):

1. Routing gives this rank's (token, expert, weight) *pairs* for its own tokens.
2. Counts ``C: (P, E)`` (pairs of rank ``s`` for expert ``e``) are all-gathered; from them every rank
   derives every offset without further communication (``EPPlan``).
3. Dispatch: each pair's token row goes to the expert's rank, landing directly in that rank's
   expert-major layout (expert ``j`` block, then source rank, then token order).
4. Expert MLP: ``y = (silu(x @ Wg) * (x @ Wu)).to(dtype) @ W2`` per expert; the Linear-2 epilogue
   multiplies by the router weight and stores the row into the *source* rank's combine buffer at the
   pair's slot (its position in the source's send order).
5. Combine-reduce on the source: ``out[t] = shared[t] + sum(buf[slot] for the slots of token t)``.

Each op has a pure-torch reference computing in fp32 and rounding where the kernel rounds (the SwiGLU
output and the weighted combine row are rounded to the activation dtype):
``expert_mlp_combine_reference``, ``combine_reduce_reference``, ``dispatch_reference``.
Fast paths: ``expert_mlp_combine`` (persistent Triton kernel over a tile schedule, see
``moe_schedule.py``), ``combine_reduce`` and ``push_rows`` (Triton).

Layer paths: "fused" (GPU: push dispatch, fused kernel, remote combine), "serial" (library All-to-All
both ways around the unfused grouped-matmul MLP: the baseline), "reference" (All-to-All around the
fp32 reference MLP; the CPU path), "auto" (on CUDA: fused where it was measured faster and validated,
serial otherwise, see ``FUSED_AUTO_MIN_LOCAL_EXPERTS``; reference elsewhere).

Dispatch choice: with real ranks on GPUs we push rows through a symmetric-memory peer table
(``push_rows``): the source knows every destination row from ``C``, so rows land already in expert-major
order, no permutation pass and no second size exchange; it also works for several processes sharing
one GPU, where NCCL refuses. On CPU (gloo) and in ``path="reference"`` the library
``all_to_all_single`` with split sizes is used.

EP layers: ``NucleusMoEEPLayer.from_layer(layer, group)`` (expert-choice routing kept global over the
sharded sequence) and ``HiDreamMoEEPLayer.from_layer(layer, group)`` (top-k + shared experts). Their
input on each rank is the rank's contiguous sequence shard ``(batch, seq_local, hidden)``, shards in rank
order; they hold only this rank's experts. Inference only (no autograd through the expert path).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from xstage_dit.comm.distributed import symmetric_buffer, world_of
from xstage_dit.ops.triton_alloc import install_descriptor_allocator
from xstage_dit.schedule.moe_tiles import TileSchedule, build_schedule

log = logging.getLogger(__name__)

__all__ = [
    "MoEKernelConfig",
    "EPPlan",
    "build_ep_plan",
    "expert_mlp_reference",
    "expert_mlp_combine_reference",
    "expert_mlp_combine",
    "expert_mlp_combine_grouped",
    "combine_reduce_reference",
    "combine_reduce",
    "push_rows",
    "dispatch_reference",
    "NucleusMoEEPLayer",
    "HiDreamMoEEPLayer",
]


# --------------------------------------------------------------------------------------------------
# Kernel configuration
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEKernelConfig:
    """Tile shapes and launch shape of the persistent expert-MLP kernel.

    block_m rows per block; block_n1 intermediate columns per Linear-1 tile (gate and up each);
    block_n2 hidden columns per Linear-2 tile; block_k reduction step. num_programs: persistent grid
    size (default: number of SMs). lead: None = chosen by ``choose_moe_lead``; 0 = wave-by-wave.
    use_desc: TMA tensor-descriptor loads of x, weights and the SwiGLU output (sm_90+; rows and weight
    rows 16-byte aligned, expert stride of each weight = its K rows). None (default): descriptors where
    the GPU and the operands allow them, else pointer loads; True: descriptors or ValueError.
    num_stages: software-pipeline depth; None: 4 with descriptors, 3 with pointer loads (each the
    fastest timed for its path). No warp-specialization option:
    Triton 3.6 does not specialize a K loop inside the persistent tile loop (see ``_moe_kernel.py``).
    """

    # Defaults: the fastest of the configs timed on the H200 (benchmarks/results/moe-tma-h200.md, NucleusMoE
    # shape: TMA descriptors with 4 stages 1.30x the grouped-matmul reference at 1 rank, 1.43-1.47x at 4;
    # pointer loads with 3 stages 1.12x). The static stride was faster still at 1 rank (1.37x) but needs
    # every program resident, so the atomic ticket stays the default.
    block_m: int = 128
    block_n1: int = 128
    block_n2: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int | None = None
    num_programs: int | None = None
    lead: int | None = None
    wave_blocks: int | None = None
    ticket: bool = True  # False: static tile stride (no atomic per tile; needs every program resident)
    use_desc: bool | None = None

    def __post_init__(self):
        for name in ("block_m", "block_n1", "block_n2", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"expected {name} a power of two >= 16, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"expected num_warps in (1, 2, 4, 8, 16), got {self.num_warps}")
        if self.lead is not None and self.lead < 0:
            raise ValueError(f"expected lead >= 0 or None, got {self.lead}")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"expected num_stages >= 1 or None, got {self.num_stages}")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# --------------------------------------------------------------------------------------------------
# Routing plan: every offset from the count matrix
# --------------------------------------------------------------------------------------------------


@dataclass
class EPPlan:
    """Where every row goes, for rank ``rank`` of ``world_size`` (see module docstring).

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
    El = E // P
    device = token_idx.device
    mine = torch.bincount(expert_idx.to("cpu"), minlength=E)
    if mine.shape[0] != E or not torch.equal(mine, counts[rank]):
        raise ValueError(f"expected counts[{rank}] to match this rank's pairs, got {counts[rank].tolist()} vs {mine.tolist()}")

    # Source side: send order sorted by (expert, token): groups by destination rank, slot = position.
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
    push_dest_rank = dest.to(torch.int32).to(device)
    push_dest_row = push_row.to(torch.int32).to(device)

    tok_order = torch.argsort(send_token_idx, stable=True)
    per_tok = torch.bincount(send_token_idx, minlength=num_tokens) if num_tokens else torch.zeros(0, dtype=torch.int64)
    slot_offsets = torch.zeros(num_tokens + 1, dtype=torch.int32, device=device)
    slot_offsets[1:] = torch.cumsum(per_tok, 0).to(torch.int32)
    slots = tok_order.to(torch.int32)

    # Expert side.
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

    return EPPlan(
        rank=rank,
        world_size=P,
        num_experts=E,
        num_tokens=num_tokens,
        counts=counts,
        send_token_idx=send_token_idx,
        send_expert=send_expert,
        send_weight=send_weight,
        send_splits=send_splits,
        push_dest_rank=push_dest_rank,
        push_dest_row=push_dest_row,
        slot_offsets=slot_offsets,
        slots=slots.to(device),
        expert_offsets=expert_offsets,
        recv_splits=recv_splits,
        em_from_recv=em_from_recv.to(device),
        em_to_recv=em_pos.to(device),
        combine_dest_rank=combine_dest_rank.to(device),
        combine_dest_row=combine_dest_row.to(device),
        capacity_recv=int(counts.reshape(P, P, El).sum((0, 2)).max()) if P else 0,
        capacity_slots=int(counts.sum(1).max()),
    )


# --------------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------------


def _check_expert_inputs(x, gate_up, down, expert_offsets) -> tuple[int, int, int]:
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
    El, H, I = _check_expert_inputs(x, gate_up, down, expert_offsets)
    y = torch.zeros(x.shape[0], H, dtype=torch.float32, device=x.device)
    for e in range(El):
        a, b = int(expert_offsets[e]), int(expert_offsets[e + 1])
        if a == b:
            continue
        gu = x[a:b].float() @ gate_up[e].float()
        h = (F.silu(gu[:, :I]) * gu[:, I:]).to(x.dtype).float()
        y[a:b] = h @ down[e].float()
    return y


def _check_combine_args(x, row_weight, dest_rank, dest_row):
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
    _check_combine_args(x, row_weight, dest_rank, dest_row)
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
    tok_of_slot = torch.repeat_interleave(torch.arange(tokens, device=buf.device), counts)
    out.index_add_(0, tok_of_slot, buf[slots.long()].float())
    return out.to(out_dtype or buf.dtype)


def dispatch_reference(
    x: torch.Tensor, send_token_idx: torch.Tensor, send_splits: list[int], recv_splits: list[int], group=None
) -> torch.Tensor:
    """Library All-to-All of the rows ``x[send_token_idx]`` (received order: source-major).

    x: (tokens, C); returns (sum(recv_splits), C). World 1: a gather.
    """
    return _all_to_all_rows(x[send_token_idx], send_splits, recv_splits, group)


def _all_to_all_rows(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """``all_to_all_single`` of rows with split sizes; gloo with CUDA tensors goes through the host."""
    _, world = world_of(group)
    if world == 1:
        return send
    via_host = send.is_cuda and dist.get_backend(group) == "gloo"
    src = send.contiguous().cpu() if via_host else send.contiguous()
    recv = src.new_empty(sum(recv_splits), *send.shape[1:])
    dist.all_to_all_single(recv, src, recv_splits, send_splits, group=group)
    return recv.to(send.device) if via_host else recv


# --------------------------------------------------------------------------------------------------
# Fast paths (Triton)
# --------------------------------------------------------------------------------------------------


@functools.cache
def _kernels():
    from xstage_dit.ops.moe import kernel as _moe_kernel

    return _moe_kernel


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_SCHEDULES: dict[tuple, TileSchedule] = {}


def _schedule_for(expert_offsets, H, I, cfg: MoEKernelConfig, lead: int, num_programs: int, device) -> TileSchedule:
    key = (tuple(expert_offsets), H, I, cfg.block_m, cfg.block_n1, cfg.block_n2, lead, cfg.wave_blocks, num_programs, str(device))
    s = _SCHEDULES.get(key)
    if s is None:
        s = build_schedule(
            list(expert_offsets),
            hidden=H,
            intermediate=I,
            block_m=cfg.block_m,
            block_n1=cfg.block_n1,
            block_n2=cfg.block_n2,
            lead=lead,
            wave_blocks=cfg.wave_blocks,
            num_programs=num_programs,
        ).to(device)
        if len(_SCHEDULES) > 256:
            _SCHEDULES.clear()
        _SCHEDULES[key] = s
    return s


@functools.cache
def _cached_xparams(target: str):
    """This machine's cached X-Stage params for ``target`` ("local" | "nvlink"), looked up once; None without.

    Only an existing calibration is read: the hot path never starts a measurement (run ``xstage-dit
    calibrate`` or ``xstage_dit.calibrate()`` at start-up for that). Set XSTAGE_MOE_CALIBRATE=1 to let
    the first MoE call calibrate on a cache miss.
    """
    try:  # calibration is optional: without it the chooser says so in its reason.
        from xstage_dit.calibration import runner as calibration

        if os.environ.get("XSTAGE_MOE_CALIBRATE") == "1":
            return calibration.load_or_calibrate(quick=True, target=target).params.get(target)
        cached = calibration.load_cache(calibration.machine_key(None), None, [target])
        return cached.params.get(target) if cached is not None else None
    except Exception as exc:  # noqa: BLE001 - any failure means "no calibration"
        log.info("no X-Stage calibration for the MoE lead (%s): choosing without it", exc)
        return None


def default_lead(H: int, I: int, expert_offsets: Sequence[int], cfg: MoEKernelConfig, num_programs: int, world_size: int):
    """``choose_moe_lead`` for this layout with this machine's calibration (target "nvlink" for world > 1)."""
    from xstage_dit.schedule.choices import choose_moe_lead

    xparams = None if _interpreting() else _cached_xparams("nvlink" if world_size > 1 else "local")
    return choose_moe_lead(
        xparams,
        hidden=H,
        intermediate=I,
        rows_per_expert=max(1, expert_offsets[-1] // max(1, len(expert_offsets) - 1)),
        num_experts_per_rank=len(expert_offsets) - 1,
        block_m=cfg.block_m,
        block_n1=cfg.block_n1,
        block_n2=cfg.block_n2,
        num_producers=num_programs,
        dtype_bytes=2,
    )


def expert_mlp_combine(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    expert_offsets: Sequence[int],
    row_weight: torch.Tensor,
    dest_rank: torch.Tensor,
    dest_row: torch.Tensor,
    combine_table: torch.Tensor,
    *,
    combine_row_stride: int | None = None,
    config: MoEKernelConfig | None = None,
    lead: int | None = None,
    h_buffer: torch.Tensor | None = None,
    schedule: TileSchedule | None = None,
) -> TileSchedule:
    """Fused expert MLP with remote combine (persistent Triton kernel); see ``expert_mlp_combine_reference``.

    x: (rows, hidden) expert-major, contiguous, bf16/fp16/fp32; gate_up: (E_local, hidden, 2*inter);
    down: (E_local, inter, hidden); expert_offsets: E_local+1 host ints; row_weight: fp32 (rows,);
    dest_rank, dest_row: int32 (rows,); combine_table: int64 (world,) addresses of each rank's
    combine buffer (x.dtype, row stride ``combine_row_stride``, default hidden).
    lead: 0 = wave-by-wave, D >= 1 interleaved; None = ``config.lead`` or ``choose_moe_lead``.
    Returns the schedule that ran. Example: see ``benchmarks/bench_moe_combine.py``.
    """
    El, H, I = _check_expert_inputs(x, gate_up, down, expert_offsets)
    _check_combine_args(x, row_weight, dest_rank, dest_row)
    cfg = config or (MoEKernelConfig(16, 16, 16, 16, 4, 1) if _interpreting() else MoEKernelConfig())
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"expected x dtype bf16, fp16 or fp32, got {x.dtype}")
    for name, t in (("gate_up", gate_up), ("down", down)):
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"expected {name} {x.dtype} on {x.device}, got {t.dtype} on {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"expected {name} with unit stride in its last dim, got strides {t.stride()}")
    if not x.is_contiguous():
        raise ValueError(f"expected contiguous x, got strides {x.stride()}")
    if row_weight.dtype != torch.float32 or dest_rank.dtype != torch.int32 or dest_row.dtype != torch.int32:
        raise ValueError(
            f"expected row_weight fp32, dest_rank/dest_row int32, got {row_weight.dtype}, {dest_rank.dtype}, {dest_row.dtype}"
        )
    if combine_table.dtype != torch.int64 or combine_table.dim() != 1 or combine_table.device != x.device:
        raise ValueError(
            f"expected combine_table int64 (world,) on {x.device}, got {combine_table.dtype} {tuple(combine_table.shape)} on {combine_table.device}"
        )
    if x.device.type != "cuda" and not _interpreting():
        raise RuntimeError(f"expert_mlp_combine needs a CUDA device or TRITON_INTERPRET=1, got {x.device}")
    rows = x.shape[0]
    if h_buffer is None:
        h_buffer = torch.empty(rows, I, dtype=x.dtype, device=x.device)
    elif h_buffer.shape[0] < rows or h_buffer.shape[1] != I or h_buffer.dtype != x.dtype or h_buffer.stride(1) != 1:
        raise ValueError(f"expected h_buffer ({rows}+, {I}) {x.dtype}, got {tuple(h_buffer.shape)} {h_buffer.dtype}")
    if x.device.type == "cuda":
        num_programs = cfg.num_programs or _num_sms(x.device.index if x.device.index is not None else torch.cuda.current_device())
    else:
        num_programs = cfg.num_programs or 2
    if schedule is None:
        if lead is None:
            lead = cfg.lead
        if lead is None:
            lead = int(default_lead(H, I, list(expert_offsets), cfg, num_programs, int(combine_table.shape[0])).params["lead"])
        schedule = _schedule_for(expert_offsets, H, I, cfg, lead, num_programs, x.device)
    if schedule.num_tiles == 0:
        return schedule
    elem = x.element_size()
    row_stride = combine_row_stride if combine_row_stride is not None else H
    if (row_stride * elem) % 16 or h_buffer.data_ptr() % 16:
        raise ValueError(
            f"expected 16-byte aligned combine rows and h_buffer, got row stride {row_stride} x {elem} B, "
            f"h_buffer at {h_buffer.data_ptr():#x}"
        )
    # Destinations as element offsets from h_buffer: the kernel then knows their alignment (16-byte stores).
    table_off = (combine_table - h_buffer.data_ptr()) // elem
    use_desc = _resolve_use_desc(cfg.use_desc, x, gate_up, down, h_buffer, H, I)
    if use_desc:
        install_descriptor_allocator()
    num_stages = cfg.num_stages if cfg.num_stages is not None else (4 if use_desc else 3)
    sync = torch.zeros(1 + schedule.num_blocks, dtype=torch.int32, device=x.device)
    grid = (min(num_programs, schedule.num_tiles),)
    if not cfg.ticket and _interpreting():
        grid = (1,)  # the interpreter runs programs one after another: a static stride needs one program
    _kernels()._moe_mlp_combine_kernel[grid](
        x, gate_up, down, h_buffer,
        h_buffer, table_off, dest_rank, dest_row, row_weight,
        schedule.tiles, schedule.blocks, sync, schedule.num_tiles, rows, El,
        x.stride(0),
        gate_up.stride(0), gate_up.stride(1), gate_up.stride(2),
        h_buffer.stride(0),
        down.stride(0), down.stride(1), down.stride(2),
        row_stride,
        H=H, I=I, N1=schedule.n1, ELEM_BYTES=elem, BM=cfg.block_m, BN1=cfg.block_n1, BN2=cfg.block_n2, BK=cfg.block_k,
        TICKET=cfg.ticket, USE_DESC=use_desc, PROXY_FENCE=use_desc and not _interpreting(),
        num_warps=cfg.num_warps, num_stages=num_stages,
    )  # fmt: skip
    return schedule


def _resolve_use_desc(use_desc: bool | None, x, gate_up, down, h_buffer, H: int, I: int) -> bool:
    """``MoEKernelConfig.use_desc`` for these operands: True checks the descriptor constraints (ValueError
    naming the first one broken); None takes descriptors on a CUDA GPU of compute capability 9.0+ whose
    operands meet them (pointer loads otherwise, e.g. under the interpreter or on an unaligned view)."""
    if use_desc:
        _check_desc_operands(x, gate_up, down, h_buffer, H, I)
        return True
    if use_desc is not None or _interpreting() or x.device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    try:
        _check_desc_operands(x, gate_up, down, h_buffer, H, I)
    except ValueError:
        return False
    return True


def _check_desc_operands(x, gate_up, down, h_buffer, H: int, I: int) -> None:
    """TMA descriptor constraints of ``use_desc``: 16-byte aligned bases and row strides, and each weight's
    expert stride equal to its K rows (the kernel views gate_up as (E*H, 2I) and down as (E*I, H))."""
    elem = x.element_size()
    for name, t in (("x", x), ("gate_up", gate_up), ("down", down), ("h_buffer", h_buffer)):
        if t.data_ptr() % 16:
            raise ValueError(f"expected {name} 16-byte aligned for use_desc, got address {t.data_ptr():#x}")
    strides = (("x row", x.stride(0)), ("gate_up row", gate_up.stride(1)), ("down row", down.stride(1)),
               ("h_buffer row", h_buffer.stride(0)), ("intermediate (up column offset)", I))  # fmt: skip
    for name, st in strides:
        if (st * elem) % 16:
            raise ValueError(f"expected {name} stride a multiple of 16 bytes for use_desc, got {st} x {elem} B")
    if gate_up.stride(0) != H * gate_up.stride(1) or down.stride(0) != I * down.stride(1):
        raise ValueError(
            f"expected expert strides of gate_up / down = {H} / {I} rows for use_desc, got strides "
            f"{gate_up.stride()} / {down.stride()}"
        )


def push_rows(
    src: torch.Tensor, src_idx: torch.Tensor, dest_table: torch.Tensor, dest_rank: torch.Tensor, dest_row: torch.Tensor,
    *, dest_row_stride: int | None = None,
) -> None:
    """Dispatch push: ``dest[dest_rank[i]][dest_row[i]] = src[src_idx[i]]`` through a pointer table.

    src: (n_src, C) contiguous rows; src_idx, dest_rank, dest_row: int32 (n,); dest_table: int64 (world,)
    addresses of each rank's (rows, C) buffer of src.dtype with row stride dest_row_stride (default C).
    """
    if src.dim() != 2 or src.stride(1) != 1:
        raise ValueError(f"expected src (n_src, C) with unit column stride, got {tuple(src.shape)} strides {src.stride()}")
    n = src_idx.shape[0]
    for name, t in (("src_idx", src_idx), ("dest_rank", dest_rank), ("dest_row", dest_row)):
        if t.dtype != torch.int32 or t.shape != (n,) or t.device != src.device:
            raise ValueError(f"expected {name} int32 ({n},) on {src.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if n == 0:
        return
    C = src.shape[1]
    elem = src.element_size()
    stride = dest_row_stride if dest_row_stride is not None else C
    # Destinations as element offsets from src (exact: allocations are 16-byte aligned); rows that start on
    # 16 bytes are declared so, for 16-byte stores.
    if src.data_ptr() % elem:
        raise ValueError(f"expected src aligned to its element size, got address {src.data_ptr():#x}")
    align = 16 // elem if (stride * elem) % 16 == 0 and src.data_ptr() % 16 == 0 else 1
    table_off = (dest_table - src.data_ptr()) // elem
    BC = min(256, triton_next_pow2(C))
    BR = 16 if _interpreting() else max(1, 4096 // BC)
    grid = (-(-n // BR), -(-C // BC))
    _kernels()._push_rows_kernel[grid](
        src, src_idx, table_off, dest_rank, dest_row, n, C, src.stride(0), stride,
        ALIGN=align, BR=BR, BC=BC,
    )  # fmt: skip


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def combine_reduce(
    buf: torch.Tensor, slot_offsets: torch.Tensor, slots: torch.Tensor, shared: torch.Tensor | None, out_dtype=None
) -> torch.Tensor:
    """Fast ``combine_reduce_reference`` (Triton, one program per token and column block); fp32 sum.

    Runs the reference on CPU without the interpreter.
    """
    if buf.device.type != "cuda" and not _interpreting():
        return combine_reduce_reference(buf, slot_offsets, slots, shared, out_dtype)
    tokens = slot_offsets.shape[0] - 1
    C = buf.shape[1]
    if buf.stride(1) != 1:
        raise ValueError(f"expected buf with unit column stride, got strides {buf.stride()}")
    if slot_offsets.dtype != torch.int32 or slots.dtype != torch.int32:
        raise ValueError(f"expected int32 slot_offsets and slots, got {slot_offsets.dtype}, {slots.dtype}")
    if shared is not None and (tuple(shared.shape) != (tokens, C) or shared.stride(1) != 1):
        raise ValueError(f"expected shared ({tokens}, {C}) with unit column stride, got {tuple(shared.shape)}")
    out = torch.empty(tokens, C, dtype=out_dtype or buf.dtype, device=buf.device)
    if tokens == 0:
        return out
    BC = min(1024, triton_next_pow2(C)) if not _interpreting() else min(64, triton_next_pow2(C))
    _kernels()._combine_reduce_kernel[(tokens, -(-C // BC))](
        buf, slot_offsets, slots, shared if shared is not None else buf, out, C,
        buf.stride(0), shared.stride(0) if shared is not None else 0, out.stride(0),
        HAS_SHARED=shared is not None, BC=BC,
    )  # fmt: skip
    return out


def expert_mlp_combine_grouped(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    expert_offsets: Sequence[int] | torch.Tensor,
    row_weight: torch.Tensor,
    dest_rank: torch.Tensor,
    dest_row: torch.Tensor,
    combine_buffers: Sequence[torch.Tensor],
) -> None:
    """Unfused baseline: grouped matmul Linear-1, SwiGLU pass, grouped matmul Linear-2, weighting, scatter.

    Same contract as ``expert_mlp_combine_reference`` but in the activation dtype with ``F.grouped_mm``
    on CUDA (per-expert matmuls elsewhere). This is the path the fused kernel is measured against.
    """
    offs_list = [int(v) for v in (expert_offsets.tolist() if torch.is_tensor(expert_offsets) else expert_offsets)]
    El, H, I = _check_expert_inputs(x, gate_up, down, offs_list)
    if x.device.type == "cuda" and hasattr(F, "grouped_mm"):
        offs = torch.tensor(offs_list[1:], dtype=torch.int32, device=x.device)
        gu = F.grouped_mm(x, gate_up, offs=offs)
        h = F.silu(gu[:, :I]) * gu[:, I:]
        y = F.grouped_mm(h, down, offs=offs)
    else:
        y = torch.empty(x.shape[0], H, dtype=x.dtype, device=x.device)
        for e in range(El):
            a, b = offs_list[e], offs_list[e + 1]
            gu = x[a:b] @ gate_up[e]
            y[a:b] = (F.silu(gu[:, :I]) * gu[:, I:]) @ down[e]
    rows = y * row_weight[:, None].to(y.dtype)  # one pass in the activation dtype (no fp32 copy of y)
    if len(combine_buffers) == 1:
        combine_buffers[0].index_copy_(0, dest_row.long(), rows)
        return
    for r, buf in enumerate(combine_buffers):
        sel = (dest_rank == r).nonzero().flatten()
        buf.index_copy_(0, dest_row[sel].long(), rows[sel])


# --------------------------------------------------------------------------------------------------
# EP core shared by the layers
# --------------------------------------------------------------------------------------------------


def _all_gather_list(t: torch.Tensor, group) -> list[torch.Tensor]:
    """all_gather of equal-shape tensors; gloo with CUDA tensors (ranks sharing a GPU) goes through the host."""
    _, world = world_of(group)
    if world == 1:
        return [t]
    via_host = t.is_cuda and dist.get_backend(group) == "gloo"
    src = t.contiguous().cpu() if via_host else t.contiguous()
    parts = [torch.empty_like(src) for _ in range(world)]
    dist.all_gather(parts, src, group=group)
    return [p.to(t.device) for p in parts] if via_host else parts


def _all_gather_counts(mine: torch.Tensor, group) -> torch.Tensor:
    return torch.stack([p.cpu() for p in _all_gather_list(mine, group)])


EP_PATHS = ("auto", "fused", "serial", "reference")


# `auto` runs the fused kernel only where it was measured faster (benchmarks/results/moe-combine-h200.md):
# with >= 16 local experts (NucleusMoE: 1.30x at 128 local experts with TMA descriptors, moe-tma-h200.md;
# 1.21-1.39x at 64/32/16 per rank with pointer loads, moe-combine-h200.md).
# Few large experts (HiDream: 4/2/1 per rank) ran 0.84-1.00x, so they take the serial path. The
# multi-process fused path matches diffusers' layer on the GPU (two processes sharing the H200:
# benchmarks/diag_moe_two_procs.py, 0.5 % vs diffusers, 0.1 % vs the EP reference path).
FUSED_AUTO_MIN_LOCAL_EXPERTS = 16


@functools.cache
def _log_auto_path(choice: str, reason: str) -> None:
    log.info("EP MoE path auto -> %s (%s)", choice, reason)


def _resolve_path(path: str, device: torch.device, world: int, num_local_experts: int) -> str:
    if path not in EP_PATHS:
        raise ValueError(f"expected path in {EP_PATHS}, got {path!r}")
    if path == "auto":
        if device.type != "cuda":
            return "reference"
        if num_local_experts < FUSED_AUTO_MIN_LOCAL_EXPERTS:
            _log_auto_path("serial", f"{num_local_experts} local experts < {FUSED_AUTO_MIN_LOCAL_EXPERTS}: "
                                     "the fused kernel was measured slower than grouped matmul there")
            return "serial"
        return "fused"
    if path == "fused" and device.type != "cuda":
        raise RuntimeError(f"path='fused' needs CUDA tensors, got {device}")
    return path


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
    group=None,
    path: str = "auto",
    config: MoEKernelConfig | None = None,
) -> torch.Tensor:
    """Expert-parallel routed MoE on this rank's tokens; returns (tokens, hidden) in x.dtype.

    x: (tokens, hidden) local tokens; token_idx, expert_idx, weight: this rank's pairs (local token,
    global expert, router weight); gate_up/down: this rank's experts; shared: (tokens, hidden) added
    in the reduce, or None. Collective over ``group``.
    """
    rank, world = world_of(group)
    tokens = x.shape[0]
    mine = torch.bincount(expert_idx, minlength=num_experts)
    counts = _all_gather_counts(mine, group)
    plan = build_ep_plan(token_idx, expert_idx, weight, counts, rank=rank, num_tokens=tokens)
    path = _resolve_path(path, x.device, world, gate_up.shape[0])
    H = x.shape[1]
    if path in ("reference", "serial"):
        # Library All-to-All both ways around the expert MLP: fp32 reference MLP ("reference"), or the
        # unfused grouped-matmul MLP in the activation dtype ("serial", the baseline the fused path beats).
        recv = dispatch_reference(x, plan.send_token_idx, plan.send_splits, plan.recv_splits, group)
        recv_w = _all_to_all_rows(plan.send_weight[:, None], plan.send_splits, plan.recv_splits, group)[:, 0]
        x_em = recv[plan.em_from_recv]
        w_em = recv_w[plan.em_from_recv]
        if path == "reference":
            rows = (expert_mlp_reference(x_em, gate_up, down, plan.expert_offsets) * w_em[:, None]).to(x.dtype)
        else:
            rows = torch.empty_like(x_em)
            expert_mlp_combine_grouped(x_em, gate_up, down, plan.expert_offsets, w_em, torch.zeros_like(plan.combine_dest_rank),
                                       torch.arange(x_em.shape[0], device=x.device, dtype=torch.int32), [rows])  # fmt: skip
        buf = _all_to_all_rows(rows[plan.em_to_recv], plan.recv_splits, plan.send_splits, group)  # back to the sources
        if path == "reference":
            return combine_reduce_reference(buf, plan.slot_offsets, plan.slots, shared, x.dtype)
        return combine_reduce(buf, plan.slot_offsets, plan.slots, shared.contiguous() if shared is not None else None, x.dtype)

    # Fused: push dispatch, persistent expert kernel with remote combine, reduce.
    x = x.contiguous()
    cap_recv = triton_next_pow2(max(1, plan.capacity_recv))
    cap_slots = triton_next_pow2(max(1, plan.capacity_slots))
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
        plan.combine_dest_rank, plan.combine_dest_row, comb.ptr_table, config=config,
    )  # fmt: skip
    comb.barrier()
    out = combine_reduce(comb.tensor, plan.slot_offsets, plan.slots, shared, x.dtype)
    # Nobody may push the next layer's rows into buffers a peer is still reading.
    comb.barrier()
    return out


def _check_sharding(num_experts: int, group) -> tuple[int, int, int]:
    rank, world = world_of(group)
    if num_experts % world:
        raise ValueError(f"expected num_experts divisible by the group size, got num_experts={num_experts}, world_size={world}")
    return rank, world, num_experts // world


def _check_shard(shard, num_experts: int) -> tuple[int, int, int]:
    """(rank, world, experts per rank) of an explicit ``shard=(rank, world)`` (a layer loaded sharded)."""
    if (not isinstance(shard, tuple) or len(shard) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in shard)):
        raise ValueError(f"expected shard=(rank, world) as two ints, got {shard!r}")
    rank, world = shard
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"expected shard=(rank, world) with world >= 1 and 0 <= rank < world, got {shard}")
    if num_experts % world:
        raise ValueError(f"expected num_experts divisible by the shard world, got num_experts={num_experts}, world={world}")
    return rank, world, num_experts // world


def _check_local_experts(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"expected {name} of shape {shape} (this rank's experts), got {got}")
    return t


class _ShardBinding:
    """Which experts an EP layer holds (``shard = (rank, world)``) and whether it may run.

    A layer made by ``from_layer(layer, group)`` is bound to ``group`` at once. A layer made by
    ``from_shard`` (a pipeline loaded with ``expert_shard``) holds experts for a group that does not exist
    yet: ``parallelize`` binds it (``bind(group)``, which checks the group's rank and size) and ``restore``
    unbinds it. An unbound layer of a world > 1 refuses to run, since the other experts live on other ranks.
    """

    shard: tuple[int, int]
    bound: bool

    def bind(self, group) -> None:
        """Run over ``group`` from now on; ValueError unless its (rank, size) is this layer's shard."""
        got = world_of(group)
        if tuple(got) != tuple(self.shard):
            raise ValueError(
                f"expected a group where this rank is rank {self.shard[0]} of {self.shard[1]} (the expert shard it was "
                f"loaded with), got rank {got[0]} of {got[1]}"
            )
        self.group = group
        self.bound = True

    def unbind(self) -> None:
        """Back to the loaded state: the shard stays, the group goes (running it then raises)."""
        self.group = None
        self.bound = False

    def _check_gatherable(self) -> None:
        if not self.bound and self.shard[1] > 1:
            raise RuntimeError(
                f"expected a bound {type(self).__name__} (bind(group)) to gather the other ranks' experts, got an "
                f"unbound layer holding expert shard {self.shard[0]} of {self.shard[1]}"
            )

    def _check_bound(self) -> None:
        if not self.bound and self.shard[1] > 1:
            raise RuntimeError(
                f"expected {type(self).__name__} to run under parallelize(pipe, ParallelConfig(sp={self.shard[1]}, "
                f"ep={self.shard[1]})), got an unbound layer holding expert shard {self.shard[0]} of {self.shard[1]} "
                "(the pipeline was loaded with expert_shard; the other experts are on other ranks)"
            )


def _all_gather_expert_shards(t: torch.Tensor, group) -> torch.Tensor:
    _, world = world_of(group)
    return torch.cat(_all_gather_list(t, group), 0)


# --------------------------------------------------------------------------------------------------
# NucleusMoE
# --------------------------------------------------------------------------------------------------


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
    token_score_sums = torch.zeros(bs * slen, device=affinity.device, dtype=gating_flat.dtype)
    token_score_sums.scatter_add_(0, global_token_indices, gating_flat)
    gating_flat = gating_flat / (token_score_sums[global_token_indices] + 1e-12)
    gating_flat = gating_flat * route_scale
    return global_token_indices, gating_flat, capacity


class NucleusMoEEPLayer(_ShardBinding, nn.Module):
    """Expert-parallel replacement of diffusers' ``NucleusMoELayer`` (same forward signature).

    Input on each rank: its contiguous sequence shard ``hidden_states: (batch, seq_local, hidden)``
    (shards in rank order, any lengths), ``hidden_states_unmodulated`` likewise, ``timestep: (batch, hidden)``.
    Routing stays global: top-C per expert is taken over the whole sequence with C from the full length;
    the shared expert runs on local tokens. Holds ``num_experts / P`` experts.

    router: "exact" (default) all-gathers ``hidden_states_unmodulated`` and runs the router GEMM over the
    whole sequence, exactly as the unsharded layer does, so routing is bit-identical on any device;
    "scores" runs the router on the local shard and all-gathers the scores ``(batch, E, seq_local)``
    (E/hidden of the traffic). With "scores" the router GEMM runs on fewer rows than the unsharded
    layer's; cuBLAS may then pick another kernel and round a score differently, which can flip a
    near-tie top-C choice (seen on the H200: 1.8% output difference, two ranks vs one; CPU tests match
    bit-exactly). Example::

        ep = NucleusMoEEPLayer.from_layer(block.img_mlp, group)
        block.img_mlp = ep            # ... and back: block.img_mlp = ep.to_layer()

    A rank that loads only its experts builds the layer with `from_shard` instead (see
    `xstage_dit.models.experts`); the forward is the same.
    """

    def __init__(self, layer: nn.Module, group=None, *, path: str = "auto", config: MoEKernelConfig | None = None,
                 router: str = "exact", shard: tuple[int, int] | None = None,
                 local_experts: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        if shard is None:
            rank, world, El = _check_sharding(layer.num_experts, group)
        else:
            rank, world, El = _check_shard(shard, layer.num_experts)
        self.shard, self.bound = (rank, world), shard is None
        if path not in EP_PATHS:
            raise ValueError(f"expected path in {EP_PATHS}, got {path!r}")
        if router not in ("exact", "scores"):
            raise ValueError(f"expected router 'exact' or 'scores', got {router!r}")
        self.router = router
        self.group = group
        self.path = path
        self.config = config
        self.num_experts = layer.num_experts
        self.num_experts_per_rank = El
        self.hidden_size = layer.hidden_size
        self.moe_intermediate_dim = layer.moe_intermediate_dim
        self.capacity_factor = layer.capacity_factor
        self.use_sigmoid = layer.use_sigmoid
        self.route_scale = layer.route_scale
        self.use_grouped_mm = layer.experts.use_grouped_mm
        self.gate = layer.gate
        self.shared_expert = layer.shared_expert
        if local_experts is None:
            sl = slice(rank * El, (rank + 1) * El)
            # clone: the slice must not keep the full expert tensors alive.
            gate_up = layer.experts.gate_up_proj.detach()[sl].clone()
            down = layer.experts.down_proj.detach()[sl].clone()
        else:
            H, I = layer.hidden_size, layer.moe_intermediate_dim
            gate_up = _check_local_experts("gate_up_local", local_experts[0], (El, H, 2 * I))
            down = _check_local_experts("down_local", local_experts[1], (El, I, H))
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(down, requires_grad=False)
        self.last_routing: dict | None = None

    @classmethod
    def from_layer(cls, layer: nn.Module, group=None, **kwargs) -> "NucleusMoEEPLayer":
        """Build from a diffusers ``NucleusMoELayer`` (every rank passes its full copy); keeps this rank's experts."""
        if not all(hasattr(layer, a) for a in ("gate", "experts", "shared_expert", "capacity_factor")):
            raise TypeError(f"expected a diffusers NucleusMoELayer, got {type(layer).__name__}")
        return cls(layer, group, **kwargs)

    @classmethod
    def from_shard(cls, layer: nn.Module, gate_up_local: torch.Tensor, down_local: torch.Tensor,
                   shard: tuple[int, int], **kwargs) -> "NucleusMoEEPLayer":
        """Build from a ``NucleusMoELayer`` whose experts were never materialised (e.g. on the meta device)
        and this rank's experts only.

        gate_up_local: (E/world, hidden, 2*inter) = experts ``[rank*E/world, (rank+1)*E/world)`` of
        ``experts.gate_up_proj``; down_local: (E/world, inter, hidden) likewise; shard: (rank, world).
        The layer is unbound until ``bind(group)`` (done by `parallelize`). Only the router and the shared
        expert of ``layer`` are used; its ``experts`` tensors are never read.
        """
        if not all(hasattr(layer, a) for a in ("gate", "experts", "shared_expert", "capacity_factor")):
            raise TypeError(f"expected a diffusers NucleusMoELayer, got {type(layer).__name__}")
        return cls(layer, None, shard=shard, local_experts=(gate_up_local, down_local), **kwargs)

    def to_layer(self) -> nn.Module:
        """A full diffusers ``NucleusMoELayer`` again (collective: all-gathers the expert shards)."""
        self._check_gatherable()
        from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoELayer

        layer = NucleusMoELayer(
            self.hidden_size, self.moe_intermediate_dim, self.num_experts, self.capacity_factor,
            self.use_sigmoid, self.route_scale, self.use_grouped_mm,
        )  # fmt: skip
        layer.to(device=self.gate_up_proj.device, dtype=self.gate_up_proj.dtype)
        layer.gate = self.gate
        layer.shared_expert = self.shared_expert
        with torch.no_grad():
            layer.experts.gate_up_proj.copy_(_all_gather_expert_shards(self.gate_up_proj.data, self.group))
            layer.experts.down_proj.copy_(_all_gather_expert_shards(self.down_proj.data, self.group))
        return layer

    def _gather_seq(self, t: torch.Tensor, dim: int) -> tuple[torch.Tensor, list[int]]:
        """All-gather sequence shards along ``dim`` (shards of any lengths, rank order); returns (full, lengths)."""
        rank, world = world_of(self.group)
        s_loc = t.shape[dim]
        if world == 1:
            return t, [s_loc]
        lens = [int(v.item()) for v in _all_gather_list(torch.tensor([s_loc], dtype=torch.int64, device=t.device), self.group)]
        pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, max(lens) - s_loc]
        parts = _all_gather_list(F.pad(t, pad), self.group)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, lens)], dim=dim), lens

    def _scores(self, unmodulated: torch.Tensor, timestep: torch.Tensor | None) -> torch.Tensor:
        """diffusers' router on ``unmodulated: (B, S, H)``: scores (B, S, E) in the gate's dtype."""
        if timestep is not None:
            router_input = torch.cat([timestep.unsqueeze(1).expand(-1, unmodulated.shape[1], -1), unmodulated], dim=-1)
        else:
            router_input = unmodulated
        logits = self.gate(router_input)
        if self.use_sigmoid:
            return torch.sigmoid(logits.float()).to(logits.dtype)
        return F.softmax(logits.float(), dim=-1).to(logits.dtype)

    @torch.no_grad()
    def forward(self, hidden_states: torch.Tensor, hidden_states_unmodulated: torch.Tensor, timestep: torch.Tensor | None = None):
        """hidden_states, hidden_states_unmodulated: (batch, seq_local, hidden); returns (batch, seq_local, hidden)."""
        self._check_bound()
        bs, s_loc, dim = hidden_states.shape
        if dim != self.hidden_size:
            raise ValueError(f"expected hidden size {self.hidden_size}, got {dim}")
        if tuple(hidden_states_unmodulated.shape) != (bs, s_loc, dim):
            raise ValueError(
                f"expected hidden_states_unmodulated of shape {(bs, s_loc, dim)}, got {tuple(hidden_states_unmodulated.shape)}"
            )
        if self.router == "exact":
            # The router GEMM over the whole sequence, as the unsharded layer runs it: bit-identical scores.
            full, lens = self._gather_seq(hidden_states_unmodulated.contiguous(), 1)
            affinity = self._scores(full, timestep).transpose(1, 2)
        else:
            affinity, lens = self._gather_seq(self._scores(hidden_states_unmodulated, timestep).transpose(1, 2).contiguous(), 2)
        rank, _ = world_of(self.group)
        slen = affinity.shape[-1]
        global_idx, gating_flat, capacity = nucleus_routing(affinity, self.capacity_factor, self.route_scale)
        self.last_routing = {"global_token_indices": global_idx, "capacity": capacity}
        # This rank's pairs: chosen tokens whose position lies in this rank's shard.
        start = sum(lens[:rank])
        b = global_idx // slen
        pos = global_idx % slen
        own = (pos >= start) & (pos < start + s_loc)
        expert_of_pair = torch.arange(self.num_experts, device=global_idx.device).repeat_interleave(bs * capacity)
        token_idx = (b * s_loc + pos - start)[own]
        out = self.shared_expert(hidden_states).reshape(bs * s_loc, dim)
        routed = ep_moe_forward(
            hidden_states.reshape(bs * s_loc, dim), token_idx, expert_of_pair[own], gating_flat[own].float(),
            self.gate_up_proj, self.down_proj, out, num_experts=self.num_experts, group=self.group,
            path=self.path, config=self.config,
        )  # fmt: skip
        return routed.reshape(bs, s_loc, dim)


# --------------------------------------------------------------------------------------------------
# HiDream
# --------------------------------------------------------------------------------------------------


class HiDreamMoEEPLayer(_ShardBinding, nn.Module):
    """Expert-parallel replacement of diffusers' HiDream ``MOEFeedForwardSwiGLU`` (same forward signature).

    x: (batch, seq_local, hidden) this rank's tokens; top-k token-choice routing is local per token, the
    shared experts run on local tokens, the routed experts are sharded (``num_experts / P`` per rank),
    their w1/w3 packed as ``gate_up: (El, hidden, 2*inter)`` and w2 as ``down: (El, inter, hidden)``.
    `from_shard` builds it from this rank's experts only (a pipeline loaded with ``expert_shard``).
    """

    def __init__(self, layer: nn.Module, group=None, *, path: str = "auto", config: MoEKernelConfig | None = None,
                 shard: tuple[int, int] | None = None,
                 local_experts: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        E = len(layer.experts)
        if shard is None:
            rank, world, El = _check_sharding(E, group)
        else:
            rank, world, El = _check_shard(shard, E)
        self.shard, self.bound = (rank, world), shard is None
        if path not in EP_PATHS:
            raise ValueError(f"expected path in {EP_PATHS}, got {path!r}")
        self.group = group
        self.path = path
        self.config = config
        self.num_experts = E
        self.num_experts_per_rank = El
        self.num_activated_experts = layer.num_activated_experts
        self.gate = layer.gate
        self.shared_experts = layer.shared_experts
        self._dims = (layer.experts[0].w1.in_features, layer.experts[0].w1.out_features)
        self._force_inference_output = layer._force_inference_output
        if local_experts is None:
            mine = [layer.experts[e] for e in range(rank * El, (rank + 1) * El)]
            gate_up = torch.stack([torch.cat([m.w1.weight.detach().t(), m.w3.weight.detach().t()], dim=1) for m in mine])
            down = torch.stack([m.w2.weight.detach().t() for m in mine])
        else:
            dim, inter = self._dims
            gate_up = _check_local_experts("gate_up_local", local_experts[0], (El, dim, 2 * inter))
            down = _check_local_experts("down_local", local_experts[1], (El, inter, dim))
        self.gate_up = nn.Parameter(gate_up.contiguous(), requires_grad=False)
        self.down = nn.Parameter(down.contiguous(), requires_grad=False)
        self.last_routing: dict | None = None

    @classmethod
    def from_layer(cls, layer: nn.Module, group=None, **kwargs) -> "HiDreamMoEEPLayer":
        """Build from a diffusers HiDream ``MOEFeedForwardSwiGLU``; keeps this rank's experts."""
        if not all(hasattr(layer, a) for a in ("gate", "experts", "shared_experts", "num_activated_experts")):
            raise TypeError(f"expected a diffusers MOEFeedForwardSwiGLU, got {type(layer).__name__}")
        return cls(layer, group, **kwargs)

    @classmethod
    def from_shard(cls, layer: nn.Module, gate_up_local: torch.Tensor, down_local: torch.Tensor,
                   shard: tuple[int, int], **kwargs) -> "HiDreamMoEEPLayer":
        """Build from a ``MOEFeedForwardSwiGLU`` whose routed experts were never materialised (meta) and this
        rank's experts only: gate_up_local (E/world, hidden, 2*inter) = ``[w1.T | w3.T]`` of experts
        ``[rank*E/world, (rank+1)*E/world)``, down_local (E/world, inter, hidden) = their ``w2.T``.
        Unbound until ``bind(group)`` (done by `parallelize`).
        """
        if not all(hasattr(layer, a) for a in ("gate", "experts", "shared_experts", "num_activated_experts")):
            raise TypeError(f"expected a diffusers MOEFeedForwardSwiGLU, got {type(layer).__name__}")
        return cls(layer, None, shard=shard, local_experts=(gate_up_local, down_local), **kwargs)

    def to_layer(self) -> nn.Module:
        """A full diffusers ``MOEFeedForwardSwiGLU`` again (collective: all-gathers the expert shards)."""
        self._check_gatherable()
        from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

        dim, inter = self._dims
        layer = MOEFeedForwardSwiGLU.__new__(MOEFeedForwardSwiGLU)
        nn.Module.__init__(layer)
        from diffusers.models.transformers.transformer_hidream_image import HiDreamImageFeedForwardSwiGLU

        gate_up = _all_gather_expert_shards(self.gate_up.data, self.group)
        down = _all_gather_expert_shards(self.down.data, self.group)
        experts = []
        for e in range(self.num_experts):
            m = HiDreamImageFeedForwardSwiGLU.__new__(HiDreamImageFeedForwardSwiGLU)
            nn.Module.__init__(m)
            m.w1 = nn.Linear(dim, inter, bias=False, device=gate_up.device, dtype=gate_up.dtype)
            m.w3 = nn.Linear(dim, inter, bias=False, device=gate_up.device, dtype=gate_up.dtype)
            m.w2 = nn.Linear(inter, dim, bias=False, device=gate_up.device, dtype=gate_up.dtype)
            with torch.no_grad():
                m.w1.weight.copy_(gate_up[e, :, :inter].t())
                m.w3.weight.copy_(gate_up[e, :, inter:].t())
                m.w2.weight.copy_(down[e].t())
            experts.append(m)
        layer.shared_experts = self.shared_experts
        layer.experts = nn.ModuleList(experts)
        layer._force_inference_output = self._force_inference_output
        layer.gate = self.gate
        layer.num_activated_experts = self.num_activated_experts
        return layer

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, seq_local, hidden); returns (batch, seq_local, hidden)."""
        self._check_bound()
        bs, s_loc, dim = x.shape
        topk_idx, topk_weight, _ = self.gate(x)  # (tokens, k)
        self.last_routing = {"topk_idx": topk_idx}
        k = topk_idx.shape[1]
        tokens = bs * s_loc
        token_idx = torch.arange(tokens, device=x.device).repeat_interleave(k)
        shared = self.shared_experts(x).reshape(tokens, dim)
        out = ep_moe_forward(
            x.reshape(tokens, dim), token_idx, topk_idx.reshape(-1).long(), topk_weight.reshape(-1).float(),
            self.gate_up, self.down, shared, num_experts=self.num_experts, group=self.group,
            path=self.path, config=self.config,
        )  # fmt: skip
        return out.reshape(bs, s_loc, dim)


# The torch custom ops live with the others in xstage_dit/ops/registry.py; re-exported for callers here.
from xstage_dit.ops.registry import moe_combine_reduce_op, moe_expert_mlp_combine_op  # noqa: E402,F401
