"""Ulysses sequence-parallel attention with the post-attention All-to-All fused into the kernel.

Semantics (defined by ``ulysses_attention_reference``): on each of ``P`` ranks, ``q, k, v`` are the
rank's contiguous chunk of a sequence of ``seq_len`` tokens, ``(batch, seq_local, heads, head_dim)``;
the output, same shape, is full non-causal attention over the whole sequence restricted to the
rank's tokens:

    out_r = softmax(Q_r K^T * scale) V,   K, V = all ranks' keys/values concatenated in rank order

Sharding convention (that of ``torch.chunk``): ``L = ceil(seq_len / P)``; rank ``r`` holds tokens
``[r*L, min((r+1)*L, seq_len))``, so only the last ranks are short (possibly empty). With equal shards
``seq_len`` may be omitted; otherwise pass it. Heads need not divide by ``P``: rank ``r`` attends
``heads // P + (r < heads % P)`` heads (uneven head split; ``heads >= P`` is required).

Schedules:

- ``"serial"``: library All-to-All (NCCL on GPUs, gloo on CPUs) before and after the best single-GPU
  attention (cuDNN SDPA on the GPU). The baseline and the fallback.
- ``"fused"``: pre-attention All-to-All as remote stores into the head owners' symmetric buffers (a
  Triton push kernel: NCCL refuses two ranks on one GPU and this keeps one mechanism for both; on
  separate GPUs it is a single NVLink write per element, as NCCL's would be), a device barrier, then
  the Triton FlashAttention kernel whose epilogue writes every output tile straight into the owner's
  output buffer (DESIGN §2 "piggyback"), a device barrier, and the owner reads its rows. World size
  1 runs the same kernel with a local one-entry table: no rendezvous, no copy.
- ``"auto"``: ``xstage_dit.schedule.choose_attention_schedule`` from the calibrated X-Stage params;
  the choice and its reason are logged once per shape and kept in ``last_schedule_choice()``.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

if TYPE_CHECKING:
    from xstage_dit.ops.attention.kernel import KernelConfig

from xstage_dit.comm.distributed import local_buffer_table, symmetric_buffer, world_of

log = logging.getLogger(__name__)


def _kernels():
    # Triton is imported on first use of the fused path: the serial path and the reference stay light.
    from xstage_dit.ops.attention import kernel as _attention_kernel

    return _attention_kernel

SCHEDULES = ("auto", "fused", "serial")
FUSED_DTYPES = (torch.float16, torch.bfloat16)
FUSED_HEAD_DIMS = (16, 32, 64, 128)


# --------------------------------------------------------------------------------------- partitions


def shard_bounds(seq_len: int, world_size: int) -> list[tuple[int, int]]:
    """(start, length) of every rank's chunk of a ``seq_len`` sequence (``torch.chunk`` convention)."""
    chunk = -(-seq_len // world_size)
    return [(min(r * chunk, seq_len), max(0, min(chunk, seq_len - r * chunk))) for r in range(world_size)]


def head_split(heads: int, world_size: int) -> list[tuple[int, int]]:
    """(first head, head count) of every rank: the first ``heads % P`` ranks take one extra head."""
    if heads < world_size:
        raise ValueError(f"expected heads >= world size for Ulysses attention, got heads={heads} "
                         f"and world size {world_size}")
    base, rem = divmod(heads, world_size)
    out, start = [], 0
    for r in range(world_size):
        n = base + (1 if r < rem else 0)
        out.append((start, n))
        start += n
    return out


# ---------------------------------------------------------------------------------------- validation


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, world_size: int,
                  seq_len: int | None) -> int:
    """Validate shapes and return the total sequence length."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected {name} to be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"expected {name} of shape (batch, seq_local, heads, head_dim), got {tuple(t.shape)}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"expected q, k, v of one shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"expected q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"expected q, k, v on one device, got {q.device}, {k.device}, {v.device}")
    if not q.is_floating_point():
        raise ValueError(f"expected a floating-point dtype, got {q.dtype}")
    batch, seq_local, heads, head_dim = q.shape
    if batch < 1 or heads < 1 or head_dim < 1:
        raise ValueError(f"expected batch, heads, head_dim >= 1, got {tuple(q.shape)}")
    if seq_len is None:
        seq_len = seq_local * world_size
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"expected seq_len to be a positive int (the whole sequence), got {seq_len!r}")
    expected = shard_bounds(seq_len, world_size)[rank][1]
    if seq_local != expected:
        raise ValueError(f"expected rank {rank} of {world_size} to hold {expected} tokens of a {seq_len}-token "
                         f"sequence (chunks of ceil(seq_len / world)), got seq_local={seq_local}")
    head_split(heads, world_size)
    return seq_len


def _check_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"expected scale to be a positive finite number, got {scale!r}")
    return float(scale)


# ------------------------------------------------------------------------------------ collectives


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def _all_to_all(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """``all_to_all_single`` over flat tensors; gloo moves CUDA tensors through the host."""
    recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
    if send.is_cuda and _is_gloo(group):
        host = torch.empty(sum(recv_splits), dtype=send.dtype)
        dist.all_to_all_single(host, send.cpu(), recv_splits, send_splits, group=group)
        recv.copy_(host)
    else:
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    return recv


def _all_gather_rows(x: torch.Tensor, seq_len: int, group, world_size: int) -> torch.Tensor:
    """(batch, seq_local, ...) shards of every rank -> (batch, seq_len, ...), in rank order."""
    chunk = -(-seq_len // world_size)
    pad = torch.zeros((x.shape[0], chunk) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
    pad[:, : x.shape[1]] = x
    stage = pad.cpu() if (x.is_cuda and _is_gloo(group)) else pad
    parts = [torch.empty_like(stage) for _ in range(world_size)]
    dist.all_gather(parts, stage.contiguous(), group=group)
    return torch.cat(parts, dim=1)[:, :seq_len].to(x.device)


# -------------------------------------------------------------------------------------- reference


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Full non-causal attention in fp32, rounded to q's dtype once at the end.

    q: (batch, seq_q, heads, head_dim); k, v: (batch, seq_kv, heads, head_dim) -> (batch, seq_q, heads, head_dim).
    """
    scale = _check_scale(scale, q.shape[-1])
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qf, kf, vf, scale=scale)
    return out.transpose(1, 2).to(q.dtype)


def ulysses_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
                                scale: float | None = None, seq_len: int | None = None) -> torch.Tensor:
    """The definition of ``ulysses_attention``: gather every rank's q, k, v, attend over the whole
    sequence in fp32, keep this rank's rows.

    q, k, v: (batch, seq_local, heads, head_dim) -> (batch, seq_local, heads, head_dim), q's dtype.
    """
    rank, world_size = world_of(group)
    seq_len = _check_inputs(q, k, v, rank, world_size, seq_len)
    if world_size == 1:
        return attention_reference(q, k, v, scale)
    start, length = shard_bounds(seq_len, world_size)[rank]
    full_q, full_k, full_v = (_all_gather_rows(t, seq_len, group, world_size) for t in (q, k, v))
    return attention_reference(full_q[:, start:start + length], full_k, full_v, scale)


# ---------------------------------------------------------------------------------------- serial


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Best single-device attention on (batch, seq, heads, head_dim): cuDNN SDPA on the GPU."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if q.is_cuda and q.dtype in FUSED_DTYPES:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                          SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
    return out.transpose(1, 2)


def library_pre_all_to_all(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, rank: int, world_size: int,
                           seq_len: int) -> torch.Tensor:
    """Tokens -> heads with one library ``all_to_all_single`` (NCCL on GPUs, gloo on CPUs).

    q, k, v: (batch, seq_local, heads, head_dim) -> (3, batch, P*ceil(seq_len/P), my_heads, head_dim), rows
    past seq_len zero.
    """
    batch, seq_local, heads, head_dim = q.shape
    chunk = -(-seq_len // world_size)
    heads_of = head_split(heads, world_size)
    my_heads = heads_of[rank][1]
    # Chunk j of the send buffer is (3, batch, chunk, heads_j, head_dim) for rank j.
    qkv = torch.zeros((3, batch, chunk, heads, head_dim), dtype=q.dtype, device=q.device)
    qkv[0, :, :seq_local], qkv[1, :, :seq_local], qkv[2, :, :seq_local] = q, k, v
    send = torch.cat([qkv[:, :, :, h0:h0 + n].reshape(-1) for h0, n in heads_of])
    elems = 3 * batch * chunk * head_dim
    recv = _all_to_all(send, [elems * n for _, n in heads_of], [elems * my_heads] * world_size, group)
    return (recv.view(world_size, 3, batch, chunk, my_heads, head_dim).permute(1, 2, 0, 3, 4, 5)
            .reshape(3, batch, world_size * chunk, my_heads, head_dim))


def serial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, scale: float | None = None,
                     seq_len: int | None = None) -> torch.Tensor:
    """Library All-to-All + single-device SDPA + library All-to-All (the baseline schedule)."""
    rank, world_size = world_of(group)
    seq_len = _check_inputs(q, k, v, rank, world_size, seq_len)
    scale = _check_scale(scale, q.shape[-1])
    if world_size == 1:
        return _sdpa(q, k, v, scale).contiguous()
    batch, seq_local, heads, head_dim = q.shape
    chunk = -(-seq_len // world_size)
    heads_of = head_split(heads, world_size)
    my_heads = heads_of[rank][1]
    full = library_pre_all_to_all(q, k, v, group=group, rank=rank, world_size=world_size, seq_len=seq_len)
    full = full[:, :, :seq_len]
    out = _sdpa(full[0], full[1], full[2], scale)
    # Post: rank i gets rows [i*chunk, (i+1)*chunk) of my heads; I get my rows of everyone's heads.
    out_pad = torch.zeros((batch, world_size * chunk, my_heads, head_dim), dtype=q.dtype, device=q.device)
    out_pad[:, :seq_len] = out
    send = out_pad.view(batch, world_size, chunk, my_heads, head_dim).transpose(0, 1).reshape(-1)
    elems = batch * chunk * head_dim
    recv = _all_to_all(send, [elems * my_heads] * world_size, [elems * n for _, n in heads_of], group)
    parts, offset = [], 0
    for _, n in heads_of:
        parts.append(recv[offset:offset + elems * n].view(batch, chunk, n, head_dim))
        offset += elems * n
    return torch.cat(parts, dim=2)[:, :seq_local].contiguous()


# ----------------------------------------------------------------------------------------- fused


def _kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """A view the kernel can read: last dim contiguous, 16-byte aligned rows (else a copy)."""
    elem = t.element_size()
    ok = (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
          and all((s * elem) % 16 == 0 for s in t.stride()[:-1]))
    return t if ok else t.contiguous()


def _check_fused(q: torch.Tensor) -> str | None:
    """Why the fused kernel cannot run on q, or None."""
    if q.dtype not in FUSED_DTYPES:
        return f"expected dtype float16 or bfloat16 for the fused kernel, got {q.dtype}"
    if q.shape[-1] not in FUSED_HEAD_DIMS:
        return f"expected head_dim in {FUSED_HEAD_DIMS} for the fused kernel, got {q.shape[-1]}"
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return f"expected a CUDA device (or TRITON_INTERPRET=1) for the fused kernel, got {q.device}"
    return None


def attention_to_buffers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_table: torch.Tensor,
                         out_like: torch.Tensor, *, seq_len: int, seq_local: int, head_offset: int,
                         scale: float | None = None, config: KernelConfig | None = None):
    """The fused kernel on one rank's heads: attention over the whole sequence, output rows stored
    through ``out_table`` into their owners' buffers.

    q, k, v: (batch, >= seq_len, heads_local, head_dim): this rank's heads over the padded sequence.
    out_table: int64[num_dest] on q's device, addresses of buffers laid out like ``out_like``,
        (batch, seq_local, heads_total, head_dim); row m goes to buffer m // seq_local.
    Returns the compiled kernel (``.n_regs``, ``.n_spills``) for resource reports.
    """
    reason = _check_fused(q)
    if reason:
        raise ValueError(reason)
    batch, _, heads_local, head_dim = q.shape
    if out_like.dim() != 4 or out_like.shape[0] != batch or out_like.shape[3] != head_dim:
        raise ValueError(f"expected out buffers (batch={batch}, seq_local, heads_total, head_dim={head_dim}), "
                         f"got {tuple(out_like.shape)}")
    if out_like.stride(-1) != 1 or out_like.dtype != q.dtype:
        raise ValueError(f"expected out buffers of dtype {q.dtype} with a contiguous last dim, got "
                         f"{out_like.dtype} with strides {out_like.stride()}")
    if head_offset < 0 or head_offset + heads_local > out_like.shape[2]:
        raise ValueError(f"expected heads [{head_offset}, {head_offset + heads_local}) inside the "
                         f"{out_like.shape[2]} heads of the out buffers")
    if out_table.dtype != torch.int64 or out_table.dim() != 1 or out_table.device != q.device:
        raise ValueError(f"expected out_table int64[num_dest] on {q.device}, got {out_table.dtype} "
                         f"{tuple(out_table.shape)} on {out_table.device}")
    if seq_len > out_table.numel() * seq_local or seq_local > out_like.shape[1]:
        raise ValueError(f"expected seq_len <= num_dest * seq_local and seq_local <= buffer rows, got seq_len="
                         f"{seq_len}, num_dest={out_table.numel()}, seq_local={seq_local}, rows={out_like.shape[1]}")
    if q.shape[1] < seq_len:
        raise ValueError(f"expected q, k, v with at least seq_len={seq_len} rows, got {q.shape[1]}")
    config = config or _kernels().default_config(head_dim, q.device)
    q, k, v = (_kernel_ready(t) for t in (q, k, v))
    return _kernels().launch_attention(q, k, v, out_table, seq_len=seq_len, seq_local=seq_local, head_offset=head_offset,
                                  out_strides=tuple(out_like.stride()[:3]), scale=_check_scale(scale, head_dim),
                                  config=config)


def push_to_owners(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, in_table: torch.Tensor, in_like: torch.Tensor, *,
                   rank: int, world_size: int, seq_len: int) -> None:
    """Pre-attention All-to-All as remote stores: this rank's tokens of head h go to the owner of h.

    q, k, v: (batch, seq_local, heads, head_dim), this rank's chunk.
    in_table: int64[world] addresses of every rank's (3, batch, P*ceil(seq_len/P), heads_local_max, head_dim)
        buffer laid out like ``in_like``; rows [rank*chunk, rank*chunk + seq_local) are written.
    """
    chunk = -(-seq_len // world_size)
    q, k, v = (t.contiguous() for t in (q, k, v))
    _kernels().launch_push(q, k, v, in_table, row_offset=rank * chunk, world_size=world_size,
                      dest_strides=tuple(in_like.stride()[:4]))


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, scale: float | None = None,
                    seq_len: int | None = None, config: KernelConfig | None = None) -> torch.Tensor:
    """The fused schedule (see the module docstring). World size 1: the kernel with a local table."""
    rank, world_size = world_of(group)
    seq_len = _check_inputs(q, k, v, rank, world_size, seq_len)
    reason = _check_fused(q)
    if reason:
        raise ValueError(reason)
    batch, seq_local, heads, head_dim = q.shape
    if world_size == 1:
        out = torch.empty((batch, seq_len, heads, head_dim), dtype=q.dtype, device=q.device)
        attention_to_buffers(q, k, v, local_buffer_table([out]), out, seq_len=seq_len, seq_local=seq_len,
                             head_offset=0, scale=scale, config=config)
        return out
    if not q.is_cuda:
        raise ValueError(f"expected CUDA tensors for the fused schedule at world size {world_size} "
                         f"(symmetric memory), got {q.device}")
    chunk = -(-seq_len // world_size)
    heads_of = head_split(heads, world_size)
    head0, my_heads = heads_of[rank]
    max_heads = heads_of[0][1]
    use_nccl = dist.get_backend(group) == "nccl"
    # Allocated once per shape (first call is collective); reused afterwards, nothing rendezvouses.
    if not use_nccl:
        buf_in = symmetric_buffer("ulysses_attention.in", (3, batch, world_size * chunk, max_heads, head_dim),
                                  q.dtype, q.device, group)
    buf_out = symmetric_buffer("ulysses_attention.out", (batch, chunk, heads, head_dim), q.dtype, q.device, group)
    if use_nccl:
        # One rank per GPU: NCCL's All-to-All (kept for real multi-GPU; the push kernel below is what
        # runs, and is measured, where ranks share a GPU and NCCL refuses them).
        mine = library_pre_all_to_all(q, k, v, group=group, rank=rank, world_size=world_size, seq_len=seq_len)
        # Everyone finished reading the previous call's output before anyone overwrites it.
        buf_out.barrier()
    else:
        push_to_owners(q, k, v, buf_in.ptr_table, buf_in.tensor, rank=rank, world_size=world_size, seq_len=seq_len)
        # Everyone's rows are in my input buffer, and everyone finished reading the previous call's output.
        buf_in.barrier()
        mine = buf_in.tensor[:, :, :, :my_heads]
    attention_to_buffers(mine[0], mine[1], mine[2], buf_out.ptr_table, buf_out.tensor, seq_len=seq_len,
                         seq_local=chunk, head_offset=head0, scale=scale, config=config)
    # Every rank's tiles for my rows have landed (the barrier orders them before my reads).
    buf_out.barrier()
    return buf_out.tensor[:, :seq_local].clone()


def fused_attention_virtual_ranks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, world_size: int,
                                  scale: float | None = None, config: KernelConfig | None = None
                                  ) -> list[torch.Tensor]:
    """The fused schedule for ``world_size`` virtual ranks in one process (tests, benchmarks).

    q, k, v: (batch, seq_len, heads, head_dim), the whole sequence; it is chunked as ranks would
    hold it, every virtual rank pushes its chunk through a local pointer table into the head owners'
    input buffers, then every rank's kernel stores its output tiles into the owners' output buffers.
    Returns the per-rank outputs, (batch, seq_local_r, heads, head_dim) each.
    """
    _check_inputs(q, k, v, 0, 1, None)
    batch, seq_len, heads, head_dim = q.shape
    chunk = -(-seq_len // world_size)
    heads_of = head_split(heads, world_size)
    bounds = shard_bounds(seq_len, world_size)
    ins = [torch.zeros((3, batch, world_size * chunk, heads_of[0][1], head_dim), dtype=q.dtype, device=q.device)
           for _ in range(world_size)]
    outs = [torch.full((batch, chunk, heads, head_dim), float("nan"), dtype=q.dtype, device=q.device)
            for _ in range(world_size)]
    in_table, out_table = local_buffer_table(ins), local_buffer_table(outs)
    for r, (start, length) in enumerate(bounds):
        push_to_owners(q[:, start:start + length], k[:, start:start + length], v[:, start:start + length], in_table,
                       ins[0], rank=r, world_size=world_size, seq_len=seq_len)
    for r, (head0, n) in enumerate(heads_of):
        mine = ins[r][:, :, :, :n]
        attention_to_buffers(mine[0], mine[1], mine[2], out_table, outs[0], seq_len=seq_len, seq_local=chunk,
                             head_offset=head0, scale=scale, config=config)
    return [outs[r][:, :length] for r, (_, length) in enumerate(bounds)]


# ------------------------------------------------------------------------------------------ auto


_LAST_CHOICE: dict[str, object] = {}


def last_schedule_choice():
    """The ``ScheduleChoice`` of the most recent ``schedule="auto"`` call (None before any)."""
    return _LAST_CHOICE.get("choice")


@functools.cache
def _calibrated_params(device_str: str, target: str):
    """XStageParams for `target` on this machine, or None (with the reason) where none can be had."""
    try:
        from xstage_dit.calibration.runner import load_or_calibrate

        result = load_or_calibrate(torch.device(device_str), quick=True)
    except Exception as exc:  # no GPU, no calibration module, a failed measurement: serial is always valid
        return None, f"no calibration ({type(exc).__name__}: {exc})"
    params = result.params.get(target) or result.params.get("local")
    if params is None:
        return None, f"calibration has no '{target}' target"
    return params, f"calibration from {result.source}"


@functools.cache
def _log_choice(key: tuple, name: str, reason: str) -> None:
    log.info("ulysses_attention %s: schedule %s (%s)", key, name, reason)


def _choose(q: torch.Tensor, world_size: int, seq_len: int):
    from xstage_dit.schedule.choices import ScheduleChoice, choose_attention_schedule

    batch, _, heads, head_dim = q.shape
    unsupported = _check_fused(q)
    if unsupported or not q.is_cuda:
        choice = ScheduleChoice("serial", f"fused kernel unavailable: {unsupported or 'not a CUDA tensor'}", {})
    elif world_size == 1:
        choice = choose_attention_schedule(None, batch=batch, seq_len=seq_len, heads=heads, head_dim=head_dim,
                                           world_size=1, dtype_bytes=q.element_size())
    else:
        # Ranks sharing one GPU store into local HBM; separate GPUs store over NVLink.
        target = "nvlink" if torch.cuda.device_count() > 1 else "local"
        xparams, source = _calibrated_params(str(q.device), target)
        choice = choose_attention_schedule(xparams, batch=batch, seq_len=seq_len, heads=heads, head_dim=head_dim,
                                           world_size=world_size, dtype_bytes=q.element_size())
        if xparams is None:
            choice = ScheduleChoice(choice.name, f"{choice.reason}; {source}", choice.params)
    _LAST_CHOICE["choice"] = choice
    _log_choice((batch, seq_len, heads, head_dim, world_size, str(q.dtype)), choice.name, choice.reason)
    return choice


def _split_schedule(schedule: str) -> tuple[str, str | None]:
    """"fused:<kernel>" (the kernel chosen per shape by ``schedule.attention_kernel``, handed down) ->
    ("fused", kernel); the plain names -> (name, None)."""
    from xstage_dit.ops.attention.kernels import KERNELS

    name, _, kernel = schedule.partition(":") if isinstance(schedule, str) else (schedule, "", "")
    if name not in SCHEDULES or (kernel and (name != "fused" or kernel not in KERNELS)):
        raise ValueError(f"expected schedule in {SCHEDULES} or 'fused:<kernel>' with a kernel in {sorted(KERNELS)}, "
                         f"got {schedule!r}")
    return name, kernel or None


def _window_kernel_attention(q, k, v, kernel_name: str, *, group, scale, seq_len):
    """A stock kernel (FA4, cuDNN) writing the post-A2A through the peer window; at world size 1 the same
    kernel writes a plain output (a one-GPU user gets its speed too)."""
    from xstage_dit.ops.attention.kernels import make_kernel
    from xstage_dit.ops.attention.window_path import fused_window_attention, plain_kernel_attention

    kernel = make_kernel(kernel_name)
    if world_of(group)[1] == 1:
        return plain_kernel_attention(q, k, v, kernel, scale=scale)
    return fused_window_attention(q, k, v, group=group, kernel=kernel, scale=scale, seq_len=seq_len)


def ulysses_attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, schedule: str = "auto",
                           scale: float | None = None, seq_len: int | None = None) -> torch.Tensor:
    """Eager implementation behind the custom op (see ``ulysses_attention``)."""
    schedule, kernel_name = _split_schedule(schedule)
    rank, world_size = world_of(group)
    seq_len = _check_inputs(q, k, v, rank, world_size, seq_len)
    if schedule == "auto":
        schedule = _choose(q, world_size, seq_len).name
    if schedule == "fused" and kernel_name not in (None, "triton"):
        return _window_kernel_attention(q, k, v, kernel_name, group=group, scale=scale, seq_len=seq_len)
    if schedule == "fused":
        return fused_attention(q, k, v, group=group, scale=scale, seq_len=seq_len)
    return serial_attention(q, k, v, group=group, scale=scale, seq_len=seq_len)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, schedule: str = "auto",
                      scale: float | None = None, seq_len: int | None = None) -> torch.Tensor:
    """Sequence-parallel (Ulysses) attention over the ranks of ``group``.

    q, k, v: (batch, seq_local, heads, head_dim), this rank's chunk of the sequence (torch.chunk
        convention; pass ``seq_len`` when the chunks are unequal).
    Returns (batch, seq_local, heads, head_dim): ``softmax(q K^T * scale) V`` over all ranks' keys.
    schedule: "fused" | "serial" | "auto" (calibrated design test; see ``last_schedule_choice()``), or
        "fused:fa4" / "fused:cudnn" / "fused:triton": the fused path with that kernel writing the post-A2A
        through the peer window (the per-shape choice of ``schedule.attention_kernel``).
    scale: default ``1/sqrt(head_dim)``.

    Example::

        out = ulysses_attention(q, k, v, group=dist.group.WORLD)  # q: (2, 2304, 24, 128) bf16 per rank

    Goes through the ``xstage_dit::ulysses_attention`` custom op, so ``torch.compile`` can trace it.
    """
    from xstage_dit.ops import registry

    return registry.ulysses_attention_op(q, k, v, group=group, schedule=schedule, scale=scale, seq_len=seq_len)
