"""Triton's process environment, written once for every kernel of the project: whether Triton runs its
CPU interpreter (``interpreting``), and the global-memory scratch allocator that kernels with in-kernel
tensor descriptors need (``install_descriptor_allocator``).

Triton keeps the allocator in a ``ContextVar``: a thread (or asyncio context) that did not set it sees
Triton's null allocator and the launch fails ("no allocator was set"). Server workers launch kernels from
their own threads, so every launch of a descriptor kernel calls `install_descriptor_allocator` (one
``ContextVar.set``, a fraction of a microsecond) instead of setting it once per process.
"""

from __future__ import annotations

import os

import torch

__all__ = ["interpreting", "install_descriptor_allocator"]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``): tensors live on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # torch's caching allocator returns 256-byte aligned blocks, more than TMA descriptors need (128).
    return torch.empty(size, device="cpu" if interpreting() else "cuda", dtype=torch.int8)


def install_descriptor_allocator() -> None:
    """Make tensor-descriptor kernels launchable from the calling thread/context."""
    # Imported here so that asking `interpreting()` (the serial path, the reference) never loads Triton.
    import triton

    triton.set_allocator(_scratch)
