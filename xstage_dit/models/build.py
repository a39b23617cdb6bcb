"""Deterministic construction of pipeline components with random weights, on the target device and dtype.

Components are built directly on ``device`` in ``dtype`` (the default init of each class runs there), so a
full-size 12B transformer is initialized on the GPU in bf16 in seconds instead of minutes on the CPU.
Each component gets its own seed (``seed`` + a fixed offset) so adding a component never changes another.
"""

from __future__ import annotations

import contextlib
from typing import Callable, TypeVar

import torch

T = TypeVar("T", bound=torch.nn.Module)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_module(factory: Callable[[], T], *, seed: int, device: str | torch.device, dtype: torch.dtype) -> T:
    """Run ``factory()`` with its parameters created on ``device`` in ``dtype`` and RNG seeded by ``seed``.

    Returns the module in eval mode without gradients. The same (factory, seed, device, dtype) gives the
    same weights.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"expected a floating dtype, got {dtype}")
    device = torch.device(device)
    fork_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        with torch.device(device), _default_dtype(dtype):
            module = factory()
    # Parameters already have `dtype` (created under it); casting only the odd one out avoids diffusers'
    # keep-in-fp32 warning, which is about loading checkpoints, not random init.
    if any(p.dtype != dtype for p in module.parameters() if p.is_floating_point()):
        torch.nn.Module.to(module, dtype=dtype)
    module.eval().requires_grad_(False)
    return module


def check_vocab(tokenizer, vocab_size: int, what: str) -> None:
    """The in-code tokenizer must never emit an id outside the text encoder's embedding table."""
    from xstage_dit.models.tokenizers import max_token_id

    top = max_token_id(tokenizer)
    if top >= vocab_size:
        raise ValueError(f"expected {what} token ids < vocab_size {vocab_size}, got max id {top}")
