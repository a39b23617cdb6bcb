"""The global-memory scratch allocator that Triton kernels with in-kernel tensor descriptors need.

Triton keeps the allocator in a ``ContextVar``: a thread (or asyncio context) that did not set it sees
Triton's null allocator and the launch fails ("no allocator was set"). Server workers launch kernels from
their own threads, so every launch of a descriptor kernel calls `install_descriptor_allocator` (one
``ContextVar.set``, a fraction of a microsecond) instead of setting it once per process.
"""

from __future__ import annotations

import os

import torch
import triton


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # torch's caching allocator returns 256-byte aligned blocks, more than TMA descriptors need (128).
    device = "cpu" if os.environ.get("TRITON_INTERPRET", "0") == "1" else "cuda"
    return torch.empty(size, device=device, dtype=torch.int8)


def install_descriptor_allocator() -> None:
    """Make tensor-descriptor kernels launchable from the calling thread/context."""
    triton.set_allocator(_scratch)
