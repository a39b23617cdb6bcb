"""What ``schedule="auto"`` resolves to for one attention shape: serial where the fused kernel cannot run
(dtype, head_dim, device), else `schedule.choose_attention_schedule`'s design test on the params handed in.

The one resolution of "auto": ``parallelize`` calls `resolve_attention_decision` once per shape (the kernel
chosen from the machine's sweep, then the design test; recorded in its handle), the public op calls
`resolve_attention_schedule` when asked for "auto". Neither it nor the op loads a calibration or a sweep.
"""

from __future__ import annotations

import torch

from xstage_dit.ops.attention.checks import fused_unavailable_for
from xstage_dit.schedule.attention import FUSED_OVER_CUDNN, choose_attention_schedule
from xstage_dit.schedule.attention_kernel import BASELINE, AttentionDecision, KernelChoice
from xstage_dit.schedule.choices import ScheduleChoice
from xstage_dit.schedule.facts import DeviceFacts

__all__ = ["resolve_attention_decision", "resolve_attention_schedule"]

# choose_attention_schedule's bounds on the kernel's speed relative to cuDNN SDPA.
_RATIO_RANGE = (1e-3, 2.0)


def resolve_attention_schedule(xparams, *, batch: int, seq_len: int, heads: int, head_dim: int, world_size: int,
                               dtype: torch.dtype, device: torch.device | str,
                               facts: DeviceFacts | None = None,
                               fused_over_cudnn: float = FUSED_OVER_CUDNN) -> ScheduleChoice:
    """"fused" | "serial" (with the reason) for q of (batch, seq_len / world_size, heads, head_dim) per rank.

    xparams: the calibrated ``XStageParams`` of the ranks' target (``calibration.params_for``), or None.
    dtype / device: q's. facts: the device's facts (None = read off ``device``). fused_over_cudnn: the fused
    kernel's speed relative to cuDNN SDPA (default: ``schedule.attention.FUSED_OVER_CUDNN``, our Triton
    kernel's, from benchmarks/results/attention/).
    Example: ``resolve_attention_schedule(None, batch=1, seq_len=4608, heads=24, head_dim=128, world_size=1,
    dtype=torch.bfloat16, device="cuda:0").name == "serial"``.
    """
    device = torch.device(device)
    unsupported = fused_unavailable_for(dtype, head_dim, device)
    if unsupported or device.type != "cuda":
        return ScheduleChoice("serial", f"fused kernel unavailable: {unsupported or 'not a CUDA tensor'}", {})
    dtype_bytes = dtype.itemsize  # the element size of q, from its dtype
    return choose_attention_schedule(xparams, facts=facts or DeviceFacts.from_device(device), batch=batch,
                                     seq_len=seq_len, heads=heads, head_dim=head_dim, world_size=world_size,
                                     dtype_bytes=dtype_bytes, fused_over_cudnn=fused_over_cudnn)


def resolve_attention_decision(xparams, kernel: KernelChoice, *, batch: int, seq_len: int, heads: int,
                               head_dim: int, world_size: int, dtype: torch.dtype, device: torch.device | str,
                               facts: DeviceFacts | None = None) -> AttentionDecision:
    """The schedule for q of (batch, seq_len / world_size, heads, head_dim) per rank, given the kernel the
    machine's sweep chose for it (``schedule.attention_kernel.choose_attention_kernel``).

    World size 1: "fused:<kernel>" (plain, no window) where the kernel measured faster than torch SDPA, else
    "serial" (diffusers' own SDPA call). World size > 1: the X-Stage design test for that kernel, at its
    measured speed relative to torch SDPA where the sweep has both, decides "fused:<kernel>" vs "serial"; a kernel
    asked for by name (``kernel.forced``) runs fused.
    Example: ``resolve_attention_decision(None, choice, batch=1, seq_len=32760, heads=40, head_dim=128,
    world_size=1, dtype=torch.bfloat16, device="cuda:0").name == "fused:fa4"`` when ``choice.name == "fa4"``.
    """
    if world_size == 1:
        if kernel.name in (None, BASELINE):
            return AttentionDecision.of("serial", "world size 1: torch SDPA exactly as diffusers calls it "
                                        f"(no All-to-All to hide; kernel: {kernel.reason})", kernel)
        ratio = kernel.over_baseline
        faster = f" ({ratio:.3f}x torch SDPA)" if ratio is not None else ""
        return AttentionDecision.of(f"fused:{kernel.name}", f"world size 1: {kernel.name} on all heads, no window"
                                    f"{faster}", kernel)
    if kernel.name is None:
        return AttentionDecision.of("serial", f"no kernel writes the post-A2A here ({kernel.reason})", kernel)
    if kernel.forced:
        return AttentionDecision.of(f"fused:{kernel.name}", f"{kernel.name} through the window, asked for by name "
                                    "(no design test)", kernel)
    ratio = kernel.over_baseline
    if ratio is None:
        ratio, note = FUSED_OVER_CUDNN, f"; {kernel.name} vs torch SDPA not measured: assumed {FUSED_OVER_CUDNN}x"
    else:
        note = f"; {kernel.name} measured {ratio:.3f}x torch SDPA"
        ratio = min(max(ratio, _RATIO_RANGE[0]), _RATIO_RANGE[1])
    schedule = resolve_attention_schedule(xparams, batch=batch, seq_len=seq_len, heads=heads, head_dim=head_dim,
                                          world_size=world_size, dtype=dtype, device=device, facts=facts,
                                          fused_over_cudnn=ratio)
    name = f"fused:{kernel.name}" if schedule.name == "fused" else "serial"
    return AttentionDecision.of(name, schedule.reason + note, kernel)
