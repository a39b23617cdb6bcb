"""Fast paths of the MoE ops (Triton launchers): the fused expert MLP with remote combine, the row push
(dispatch), the combine-reduce, and the unfused grouped-matmul baseline.

Each launcher checks its tensors and launches ``kernel.py``; the semantics are those of the references in
``reference.py``. The lead (tile order) is handed in: launchers never choose a schedule, load a
calibration or read anything but the device they run on (``DeviceFacts``).
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.nn.functional as F

from xstage_dit.ops.moe.config import MoEKernelConfig, default_config, interpreting
from xstage_dit.ops.moe.reference import check_combine_args, check_expert_inputs, combine_reduce_reference
from xstage_dit.ops.triton_alloc import install_descriptor_allocator
from xstage_dit.schedule.facts import DeviceFacts
from xstage_dit.schedule.moe_tiles import TileSchedule, build_schedule

__all__ = [
    "expert_mlp_combine",
    "expert_mlp_combine_grouped",
    "expert_mlp_rows",
    "expert_mlp_rows_grouped",
    "equal_expert_offsets",
    "combine_reduce",
    "push_rows",
    "num_programs_for",
    "next_pow2",
]

# Under the interpreter programs run one after another; two still exercise the ticket hand-off.
_INTERPRETER_PROGRAMS = 2


@functools.cache
def _kernels():
    # Imported on first launch: triton's import reads TRITON_INTERPRET, which the CPU tests set first.
    from xstage_dit.ops.moe import kernel

    return kernel


def num_programs_for(device: torch.device, config: MoEKernelConfig) -> int:
    """The persistent grid: ``config.num_programs``, else one program per SM of ``device`` (DeviceFacts)."""
    if config.num_programs:
        return config.num_programs
    if device.type == "cuda":
        return DeviceFacts.from_device(device).num_sms
    return _INTERPRETER_PROGRAMS


@functools.lru_cache(maxsize=256)
def _schedule_for(expert_offsets: tuple[int, ...], H: int, I: int, block_m: int, block_n1: int, block_n2: int,
                  lead: int, wave_blocks: int | None, num_programs: int, device: str) -> TileSchedule:
    # Built once per layout: rebuilding the tile table is host work the hot path should not repeat.
    return build_schedule(list(expert_offsets), hidden=H, intermediate=I, block_m=block_m, block_n1=block_n1,
                          block_n2=block_n2, lead=lead, wave_blocks=wave_blocks, num_programs=num_programs).to(device)


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
    lead: 0 = wave-by-wave, D >= 1 interleaved (the schedule's choice, ``xstage_dit.schedule.moe``);
    None = ``config.lead``; ValueError when neither gives one (the op does not choose it).
    schedule: a prebuilt ``TileSchedule`` instead of the lead.
    Returns the schedule that ran. Example: see ``benchmarks/bench_moe_combine.py``.
    """
    El, H, I = check_expert_inputs(x, gate_up, down, expert_offsets)
    check_combine_args(x, row_weight, dest_rank, dest_row)
    cfg = config or default_config()
    lead = cfg.lead if lead is None else lead
    if schedule is None and (lead is None or isinstance(lead, bool) or not isinstance(lead, int) or lead < 0):
        raise ValueError(
            f"expected a lead int >= 0 (argument or config.lead; chosen by xstage_dit.schedule.moe), got {lead!r}"
        )
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
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError(f"expert_mlp_combine needs a CUDA device or TRITON_INTERPRET=1, got {x.device}")
    rows = x.shape[0]
    if h_buffer is None:
        h_buffer = torch.empty(rows, I, dtype=x.dtype, device=x.device)
    elif h_buffer.shape[0] < rows or h_buffer.shape[1] != I or h_buffer.dtype != x.dtype or h_buffer.stride(1) != 1:
        raise ValueError(f"expected h_buffer ({rows}+, {I}) {x.dtype}, got {tuple(h_buffer.shape)} {h_buffer.dtype}")
    num_programs = num_programs_for(x.device, cfg)
    if schedule is None:
        schedule = _schedule_for(tuple(int(v) for v in expert_offsets), H, I, cfg.block_m, cfg.block_n1, cfg.block_n2,
                                 lead, cfg.wave_blocks, num_programs, str(x.device))
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
    if not cfg.ticket and interpreting():
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
        TICKET=cfg.ticket, USE_DESC=use_desc, PROXY_FENCE=use_desc and not interpreting(),
        num_warps=cfg.num_warps, num_stages=num_stages,
    )  # fmt: skip
    return schedule


def equal_expert_offsets(num_experts: int, rows_per_expert: int) -> tuple[int, ...]:
    """``(0, R, 2R, ..., E*R)``: the expert offsets of an expert-choice layout (every expert takes R rows)."""
    if num_experts < 1 or rows_per_expert < 1:
        raise ValueError(f"expected num_experts >= 1 and rows_per_expert >= 1, got {num_experts} and {rows_per_expert}")
    return tuple(range(0, (num_experts + 1) * rows_per_expert, rows_per_expert))


def expert_mlp_rows(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    rows_per_expert: int,
    row_weight: torch.Tensor,
    *,
    lead: int,
    config: MoEKernelConfig | None = None,
) -> torch.Tensor:
    """The fused expert MLP for equal-size experts, weighted rows into one local tensor (world 1).

    x: (E_local * rows_per_expert, hidden) expert-major, contiguous; gate_up: (E_local, hidden, 2*inter);
    down: (E_local, inter, hidden); row_weight: fp32 (rows,). Returns (rows, hidden) in x.dtype,
    ``out[i] = (expert_mlp(x[i]) * row_weight[i]).to(x.dtype)`` (``expert_mlp_combine_reference`` with one
    buffer and ``dest_row = i``). No host sync: the offsets follow from the shapes, the tile table is built
    once per shape and cached on the device (``_schedule_for``), and the destination table is filled on the
    device from the output's address (capturable in a CUDA graph: the address is the graph pool's).
    """
    rows = x.shape[0]
    El = gate_up.shape[0] if gate_up.dim() == 3 else 0
    if rows_per_expert < 1 or rows != El * rows_per_expert:
        raise ValueError(
            f"expected x with E_local * rows_per_expert = {El} x {rows_per_expert} rows, got {tuple(x.shape)}"
        )
    out = torch.empty(rows, x.shape[1], dtype=x.dtype, device=x.device)
    table = torch.full((1,), out.data_ptr(), dtype=torch.int64, device=x.device)
    dest_rank = torch.zeros(rows, dtype=torch.int32, device=x.device)
    dest_row = torch.arange(rows, dtype=torch.int32, device=x.device)
    expert_mlp_combine(x, gate_up, down, equal_expert_offsets(El, rows_per_expert), row_weight, dest_rank, dest_row,
                       table, config=config, lead=lead)  # fmt: skip
    return out


def expert_mlp_rows_grouped(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, rows_per_expert: int, row_weight: torch.Tensor
) -> torch.Tensor:
    """Unfused ``expert_mlp_rows`` (the baseline): ``F.grouped_mm`` on CUDA with offsets made on the device
    (no host copy, so no sync), per-expert matmuls elsewhere; rows weighted in the activation dtype."""
    El, H, I = check_expert_inputs(x, gate_up, down, equal_expert_offsets(gate_up.shape[0], rows_per_expert))
    if x.device.type == "cuda" and hasattr(F, "grouped_mm"):
        offs = torch.arange(1, El + 1, dtype=torch.int32, device=x.device) * rows_per_expert
        gu = F.grouped_mm(x, gate_up, offs=offs)
        y = F.grouped_mm(F.silu(gu[:, :I]) * gu[:, I:], down, offs=offs)
    else:
        gu = torch.bmm(x.view(El, rows_per_expert, H), gate_up)
        y = torch.bmm(F.silu(gu[..., :I]) * gu[..., I:], down).reshape(-1, H)
    return y * row_weight[:, None].to(y.dtype)


def _resolve_use_desc(use_desc: bool | None, x, gate_up, down, h_buffer, H: int, I: int) -> bool:
    """``MoEKernelConfig.use_desc`` for these operands: True checks the descriptor constraints (ValueError
    naming the first one broken); None takes descriptors on a CUDA GPU of compute capability 9.0+ whose
    operands meet them (pointer loads otherwise, e.g. under the interpreter or on an unaligned view)."""
    if use_desc:
        _check_desc_operands(x, gate_up, down, h_buffer, H, I)
        return True
    if use_desc is not None or interpreting() or x.device.type != "cuda":
        return False
    if DeviceFacts.from_device(x.device).compute_capability[0] < 9:  # TMA needs sm_90+
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
    BC = min(256, next_pow2(C))
    BR = 16 if interpreting() else max(1, 4096 // BC)
    grid = (-(-n // BR), -(-C // BC))
    _kernels()._push_rows_kernel[grid](
        src, src_idx, table_off, dest_rank, dest_row, n, C, src.stride(0), stride,
        ALIGN=align, BR=BR, BC=BC,
    )  # fmt: skip


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): block widths and buffer capacities."""
    return 1 << max(0, (int(n) - 1).bit_length())


def combine_reduce(
    buf: torch.Tensor, slot_offsets: torch.Tensor, slots: torch.Tensor, shared: torch.Tensor | None, out_dtype=None
) -> torch.Tensor:
    """Fast ``combine_reduce_reference`` (Triton, one program per token and column block); fp32 sum.

    Runs the reference on CPU without the interpreter.
    """
    if buf.device.type != "cuda" and not interpreting():
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
    BC = min(1024, next_pow2(C)) if not interpreting() else min(64, next_pow2(C))
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
    El, H, I = check_expert_inputs(x, gate_up, down, offs_list)
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
