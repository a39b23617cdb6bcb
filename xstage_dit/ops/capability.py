"""Why a kernel cannot run on a device, by compute capability: one wording for every op that needs a recent GPU."""

from __future__ import annotations

import torch

__all__ = ["capability_refusal"]


def capability_refusal(device: torch.device | str, minimum: tuple[int, int], what: str, note: str = "") -> str | None:
    """None where `device` is a CUDA GPU of compute capability >= `minimum`, else why `what` cannot run there:
    "<what> needs a CUDA device, got cpu" / "<what> needs compute capability >= 9.0<note>, got sm80"."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{what} needs a CUDA device, got {device}"
    capability = torch.cuda.get_device_capability(device)
    if capability < minimum:
        return (f"{what} needs compute capability >= {minimum[0]}.{minimum[1]}{note}, "
                f"got sm{capability[0]}{capability[1]}")
    return None
