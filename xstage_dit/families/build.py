"""Deterministic construction of pipeline components with random weights, on the target device and dtype.

Components are built directly on ``device`` in ``dtype`` (the default init of each class runs there), so a
full-size 12B transformer is initialized on the GPU in bf16 in seconds instead of minutes on the CPU.
Each component gets its own seed (``seed`` + a fixed offset) so adding a component never changes another.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, TypeVar

import torch
from torch.overrides import TorchFunctionMode

T = TypeVar("T", bound=torch.nn.Module)

_EMPTY_FACTORIES = {torch.empty, torch.empty_like, torch.Tensor.new_empty, torch.empty_strided}


class _PoisonEmpty(TorchFunctionMode):
    """Fills every floating tensor made by an ``empty`` factory with NaN while a module is constructed.

    Some classes leave parameters to the checkpoint loader (e.g. NucleusMoE's expert weights are
    ``nn.Parameter(torch.empty(...))``): with random weights they would hold whatever memory held, which
    differs from run to run and can be NaN. After construction, a parameter still NaN was never initialized.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _EMPTY_FACTORIES and isinstance(out, torch.Tensor) and out.is_floating_point() \
                and out.device.type != "meta":
            with torch.no_grad():
                out.fill_(float("nan"))
        return out


def _init_left_uninitialized(module: torch.nn.Module) -> list[str]:
    """Initialize the parameters construction left uninitialized (all NaN after `_PoisonEmpty`).

    Matrices and stacked matrices get normal(0, 1/sqrt(fan_in)): fan_in is the last dim for 2-D
    (``nn.Linear`` layout: out x in) and the second-to-last for 3-D and up (grouped-GEMM layout:
    experts x in x out); vectors get zeros. Returns the names initialized here.
    """
    names = []
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.device.type == "meta" or not param.is_floating_point() or param.numel() == 0:
                continue
            if not torch.isnan(param).all():
                continue
            if param.dim() >= 2:
                fan_in = param.shape[-1] if param.dim() == 2 else param.shape[-2]
                param.normal_(0.0, 1.0 / math.sqrt(fan_in))
            else:
                param.zero_()
            names.append(name)
        for name, buf in module.named_buffers():
            if buf.is_floating_point() and buf.device.type != "meta" and buf.numel() and torch.isnan(buf).all():
                raise ValueError(f"expected buffer {name} of {type(module).__name__} to be initialized, got NaN")
    return names


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
        with torch.device(device), _default_dtype(dtype), _PoisonEmpty():
            module = factory()
        _init_left_uninitialized(module)  # inside fork_rng: seeded, deterministic
    empty = [name for name, p in module.named_parameters() if p.numel() == 0]
    if empty:  # a config too small for a width the class derives (e.g. rounded down to a multiple of 128)
        raise ValueError(f"expected every parameter of {type(module).__name__} to be non-empty, got empty {empty[:3]}")
    # Parameters already have `dtype` (created under it); casting only the odd one out avoids diffusers'
    # keep-in-fp32 warning, which is about loading checkpoints, not random init.
    if any(p.dtype != dtype for p in module.parameters() if p.is_floating_point()):
        torch.nn.Module.to(module, dtype=dtype)
    _plain_tensors_to_cpu(module)
    module.eval().requires_grad_(False)
    return module


def _plain_tensors_to_cpu(module: torch.nn.Module) -> None:
    """Put tensors that modules hold as plain attributes (neither parameter nor buffer) on the CPU, where a
    pipeline loaded from a folder has them: ``from_pretrained`` runs ``__init__`` on the CPU and ``.to(device)``
    moves parameters and buffers only. Built under ``torch.device(device)`` they would start on the GPU and skip
    per-forward host copies a real user's pipeline makes (NucleusMoE's and QwenImage's rope tables:
    ``pos_freqs.to(device)`` every forward), so benchmarks on random weights would time another program."""
    for sub in module.modules():
        for name, value in list(vars(sub).items()):
            if isinstance(value, torch.Tensor) and value.device.type not in ("cpu", "meta"):  # meta: no data
                setattr(sub, name, value.cpu())


def check_vocab(tokenizer, vocab_size: int, what: str) -> None:
    """The in-code tokenizer must never emit an id outside the text encoder's embedding table."""
    from xstage_dit.families.tokenizers import max_token_id

    top = max_token_id(tokenizer)
    if top >= vocab_size:
        raise ValueError(f"expected {what} token ids < vocab_size {vocab_size}, got max id {top}")


def clip_image_processor(side: int):
    """The `CLIPImageProcessor` of a CLIP vision tower of `side` x `side` pixels (resize the short edge, centre
    crop, OpenAI CLIP's mean and std): what Wan 2.1 I2V and HunyuanVideo I2V (its LLaVA text encoder) ship."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
                              image_mean=[0.48145466, 0.4578275, 0.40821073],
                              image_std=[0.26862954, 0.26130258, 0.27577711])
