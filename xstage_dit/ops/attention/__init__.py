"""Ulysses sequence-parallel attention with the post-attention All-to-All fused into the kernel.

Semantics (defined by ``ulysses_attention_reference``): on each of ``P`` ranks, ``q, k, v`` are the
rank's contiguous chunk of a sequence of ``seq_len`` tokens, ``(batch, seq_local, heads, head_dim)``;
the output, same shape, is full non-causal attention over the whole sequence restricted to the
rank's tokens:

    out_r = softmax(Q_r K^T * scale) V,   K, V = all ranks' keys/values concatenated in rank order

Sharding (`partition`): the ``torch.chunk`` convention, only the last ranks short (possibly empty); with
equal shards ``seq_len`` may be omitted, otherwise pass it. Heads need not divide by ``P`` (``heads >= P``).

Schedules: ``"serial"`` (`serial`: library All-to-All around cuDNN SDPA, the baseline and the fallback),
``"fused"`` (`table`: remote-store push, our Triton kernel storing output tiles into their owners'
buffers), ``"auto"`` (`auto.resolve_attention_schedule` on the ``xparams`` handed in; logged once per shape).
The op is handed its schedule and its params: it never loads a calibration.

Modules: `partition`, `checks`, `reference`, `serial`, `table` + `kernel` (Triton), `auto`, and here the
public op and its torch custom op ``xstage_dit::ulysses_attention`` (so ``torch.compile`` can trace it). At world
size 1 under ``torch.compile``, "fused:cudnn-fp8" runs `fp8_traced` instead (its casts visible to Inductor).
"""

from __future__ import annotations

import functools
import logging

import torch

from xstage_dit.comm.distributed import world_of
from xstage_dit.ops.attention.auto import resolve_attention_schedule
from xstage_dit.ops.attention.checks import check_inputs
from xstage_dit.ops.attention.cudnn_padded import cudnn_padded_attention
from xstage_dit.ops.attention.fp8_traced import cudnn_fp8_attention
from xstage_dit.ops.attention.partition import head_split, shard_bounds
from xstage_dit.ops.attention.reference import attention_reference, ulysses_attention_reference
from xstage_dit.ops.attention.serial import serial_attention
from xstage_dit.ops.attention.table import fused_attention, fused_attention_virtual_ranks
from xstage_dit.comm.group_names import group_name, resolve_group
from xstage_dit.ops.registry import NAMESPACE

log = logging.getLogger(__name__)

__all__ = ["FP8_TRACED_SCHEDULE", "SCHEDULES", "attention_reference", "fused_attention",
           "fused_attention_virtual_ranks", "head_split", "resolve_attention_schedule", "serial_attention",
           "shard_bounds", "takes_traced_fp8", "ulysses_attention", "ulysses_attention_impl",
           "ulysses_attention_reference"]

SCHEDULES = ("auto", "fused", "serial")
# The schedule whose compiled world-1 call runs `fp8_traced` (its casts visible to Inductor).
FP8_TRACED_SCHEDULE = "fused:cudnn-fp8"


def takes_traced_fp8(schedule: str, world_size: int) -> bool:
    """Whether an attention call with ``schedule`` over ``world_size`` ranks runs `fp8_traced` (cudnn-fp8, one
    rank, inside ``torch.compile``): the path that takes q's and k's bounds known in advance."""
    return schedule == FP8_TRACED_SCHEDULE and world_size == 1 and torch.compiler.is_compiling()


# What the custom op runs: "auto" is resolved before the op boundary, where the params are.
OP_SCHEDULES = ("fused", "serial")


def _split_schedule(schedule: str) -> tuple[str, str | None]:
    """"fused:<kernel>" (the kernel chosen per shape by ``schedule.attention_kernel``, handed down) ->
    ("fused", kernel); the plain names -> (name, None)."""
    from xstage_dit.ops.attention.kernels import KERNELS

    name, _, kernel = schedule.partition(":") if isinstance(schedule, str) else (schedule, "", "")
    if name not in SCHEDULES or (kernel and (name != "fused" or kernel not in KERNELS)):
        raise ValueError(f"expected schedule in {SCHEDULES} or 'fused:<kernel>' with a kernel in {sorted(KERNELS)}, "
                         f"got {schedule!r}")
    return name, kernel or None


@functools.cache
def _op_kernel(name: str):
    """The op's kernel object of ``name``, one per process: kernels keep their per-shape state (cuDNN graphs and
    tuned plans, FA4's small tensors) across calls, which a fresh object per call would build again every call."""
    from xstage_dit.ops.attention.kernels import make_kernel

    return make_kernel(name)


def _window_kernel_attention(q, k, v, kernel_name: str, *, group, scale, seq_len):
    """A stock kernel (FA4, cuDNN, the 8-bit ones) writing the post-A2A through the peer window; at world size 1
    the same kernel writes a plain output (a one-GPU user gets its speed too)."""
    from xstage_dit.ops.attention.window_path import (cudnn_plain_attention, fa4_plain_attention,
                                                       fused_window_attention, plain_kernel_attention)

    world_size = world_of(group)[1]
    if world_size == 1 and kernel_name == "fa4":
        # FA4 plain on (B, S, H, D): no window view, no owner table to upload, no copy (the world-1 schedule
        # "fused:fa4" that parallelize picks where FA4 measured faster than torch SDPA).
        return fa4_plain_attention(q, k, v, scale=scale)
    if world_size == 1 and kernel_name == "cudnn":
        # cuDNN's kernel through torch's backend: no window to write, so no cudnn-frontend graph per call.
        return cudnn_plain_attention(q, k, v, scale=scale)
    kernel = _op_kernel(kernel_name)
    if world_size == 1:
        return plain_kernel_attention(q, k, v, kernel, scale=scale)
    return fused_window_attention(q, k, v, group=group, kernel=kernel, scale=scale, seq_len=seq_len)


def ulysses_attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, schedule: str,
                           scale: float | None = None, seq_len: int | None = None) -> torch.Tensor:
    """Eager implementation behind the custom op: runs ``schedule`` ("fused" | "fused:<kernel>" | "serial")
    as handed in."""
    name, kernel_name = _split_schedule(schedule)
    if name not in OP_SCHEDULES:
        raise ValueError(f"expected schedule in {OP_SCHEDULES} (resolve 'auto' before the op), got {schedule!r}")
    if kernel_name not in (None, "triton"):
        return _window_kernel_attention(q, k, v, kernel_name, group=group, scale=scale, seq_len=seq_len)
    if name == "fused":
        return fused_attention(q, k, v, group=group, scale=scale, seq_len=seq_len)
    return serial_attention(q, k, v, group=group, scale=scale, seq_len=seq_len)


@torch.library.custom_op(f"{NAMESPACE}::ulysses_attention", mutates_args=())
def _ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: str, schedule: str,
                       scale: float | None, seq_len: int | None) -> torch.Tensor:
    # Process groups cannot cross the op boundary: the group travels by name (`registry.group_name`).
    return ulysses_attention_impl(q, k, v, group=resolve_group(group), schedule=schedule, scale=scale, seq_len=seq_len)


@_ulysses_attention.register_fake
def _(q, k, v, group, schedule, scale, seq_len):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@functools.cache
def _log_auto(key: tuple, name: str, reason: str) -> None:
    log.info("ulysses_attention %s: schedule %s (%s)", key, name, reason)


@torch.compiler.assume_constant_result
def _auto_schedule(xparams, batch: int, seq_len: int, heads: int, head_dim: int, world_size: int,
                   dtype: torch.dtype, device: torch.device) -> str:
    # Under torch.compile, Dynamo runs this at trace time and bakes the name into the graph: eager and
    # compiled calls resolve "auto" in this one place, logged once per shape.
    choice = resolve_attention_schedule(xparams, batch=batch, seq_len=seq_len, heads=heads, head_dim=head_dim,
                                        world_size=world_size, dtype=dtype, device=device)
    _log_auto((batch, seq_len, heads, head_dim, world_size, str(dtype)), choice.name, choice.reason)
    return choice.name


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, schedule: str = "auto",
                      scale: float | None = None, seq_len: int | None = None, xparams=None,
                      fp8_amax_bounds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Sequence-parallel (Ulysses) attention over the ranks of ``group``.

    q, k, v: (batch, seq_local, heads, head_dim), this rank's chunk of the sequence (torch.chunk
        convention; pass ``seq_len`` when the chunks are unequal).
    Returns (batch, seq_local, heads, head_dim): ``softmax(q K^T * scale) V`` over all ranks' keys.
    schedule: "fused" | "serial" | "auto" (``resolve_attention_schedule`` on ``xparams``, the calibrated
        ``XStageParams`` of the ranks' target from ``calibration.params_for``; None = uncalibrated: serial
        across ranks), or "fused:fa4" | "fused:cudnn" | "fused:triton": the fused path with that kernel writing
        the post-A2A through the peer window (the per-shape choice of ``schedule.attention_kernel``).
        scale: default ``1/sqrt(head_dim)``. fp8_amax_bounds: bounds on |q| and |k| known in advance
        (``features.qk_bounds``), taken by the compiled world-1 cudnn-fp8 path for q's and k's scales.

    Example::

        out = ulysses_attention(q, k, v, group=dist.group.WORLD, schedule="fused")  # q: (2, 2304, 24, 128) bf16

    Goes through the ``xstage_dit::ulysses_attention`` custom op, so ``torch.compile`` can trace it.
    """
    _split_schedule(schedule)
    if takes_traced_fp8(schedule, world_of(group)[1]):
        # Compiled, one rank: the quantization in torch around cuDNN's kernel alone, so that Inductor folds the
        # casts into the producers of q, k, v and the consumer of the output (`fp8_traced`; same values).
        return cudnn_fp8_attention(q, k, v, scale=scale, amax_bounds=fp8_amax_bounds)
    if schedule == "auto":
        rank, world_size = world_of(group)
        seq_len = check_inputs(q, k, v, rank, world_size, seq_len)
        batch, _, heads, head_dim = q.shape
        schedule = _auto_schedule(xparams, int(batch), int(seq_len), int(heads), int(head_dim), world_size, q.dtype,
                                  q.device)
    return torch.ops.xstage_dit.ulysses_attention(q, k, v, group_name(group), schedule,
                                                  None if scale is None else float(scale), seq_len)
