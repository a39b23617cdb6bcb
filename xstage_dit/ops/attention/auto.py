"""What ``schedule="auto"`` resolves to for one attention shape: serial where the fused kernel cannot run
(dtype, head_dim, device), else `schedule.choose_attention_schedule`'s design test on the params handed in.

The one resolution of "auto": ``parallelize`` calls it once per shape (and records the choice in its
handle), the public op calls it when asked for "auto". Neither it nor the op loads a calibration.
"""

from __future__ import annotations

import torch

from xstage_dit.ops.attention.checks import fused_unavailable_for
from xstage_dit.schedule.attention import choose_attention_schedule
from xstage_dit.schedule.choices import ScheduleChoice
from xstage_dit.schedule.facts import DeviceFacts

__all__ = ["resolve_attention_schedule"]


def resolve_attention_schedule(xparams, *, batch: int, seq_len: int, heads: int, head_dim: int, world_size: int,
                               dtype: torch.dtype, device: torch.device | str,
                               facts: DeviceFacts | None = None) -> ScheduleChoice:
    """"fused" | "serial" (with the reason) for q of (batch, seq_len / world_size, heads, head_dim) per rank.

    xparams: the calibrated ``XStageParams`` of the ranks' target (``calibration.params_for``), or None.
    dtype / device: q's. facts: the device's facts (None = read off ``device``).
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
                                     dtype_bytes=dtype_bytes)
