"""`DeviceMemory`: what a feature reads of a CUDA device's memory before it takes more (the fused LoRA mode's rule,
an adapter's fit, TaylorSeer's state), in one place."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DeviceMemory"]


@dataclass(frozen=True)
class DeviceMemory:
    """A CUDA device's memory, in bytes: free (the driver's), cached (reserved by this process's caching allocator,
    not allocated), peak_extra (the largest call so far beyond what is allocated now: ``max_memory_allocated -
    memory_allocated``), total."""

    free: int
    cached: int
    peak_extra: int
    total: int

    @classmethod
    def of(cls, device: torch.device) -> "DeviceMemory":
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        return cls(free=free, cached=torch.cuda.memory_reserved(device) - allocated,
                   peak_extra=max(torch.cuda.max_memory_allocated(device) - allocated, 0), total=total)

    @property
    def available(self) -> int:
        """Bytes a new tensor can still take: the driver's free memory plus the allocator's unused reserve."""
        return self.free + self.cached
