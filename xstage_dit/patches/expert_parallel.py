"""Expert parallelism: swap a transformer's MoE layers for the EP layers of `xstage_dit.ops.moe_combine`.

EP shares the ranks of the sequence-parallel group: each EP layer receives this rank's sequence shard
and holds ``num_experts / ep`` experts (``from_layer`` copies only this rank's experts). The original
layers are kept for `undo`, moved to the CPU while patched so only the rank's experts occupy the GPU.
"""

from __future__ import annotations

import importlib
import logging
from typing import Callable

import torch

log = logging.getLogger(__name__)


def _ep_class(path: str):
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(f"expected the EP layer {path} (xstage_dit.ops.moe_combine), got {exc!r}") from exc


def _device_of(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def apply_expert_parallel(model: torch.nn.Module, moe_layers, group) -> tuple[Callable[[], None], int]:
    """Replace every module whose class name is in `moe_layers` by its EP layer over `group`.

    moe_layers: ((diffusers class name, "module:EPClass"), ...). Returns (undo, number replaced).
    """
    classes = {name: path for name, path in moe_layers}
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Module, torch.device]] = []
    try:
        for parent_name, parent in list(model.named_modules()):
            for child_name, child in list(parent.named_children()):
                path = classes.get(type(child).__name__)
                if path is None:
                    continue
                ep_layer = _ep_class(path).from_layer(child, group)
                device = _device_of(child)
                setattr(parent, child_name, ep_layer)
                if device.type != "cpu":
                    child.to("cpu")
                swapped.append((parent, child_name, child, device))
    except BaseException:
        _undo(swapped)
        raise
    if classes and not swapped:
        log.warning("expert parallel: no %s layer found in %s", "/".join(classes), type(model).__name__)

    def undo() -> None:
        _undo(swapped)

    return undo, len(swapped)


def _undo(swapped) -> None:
    for parent, child_name, original, device in reversed(swapped):
        setattr(parent, child_name, original.to(device))
    swapped.clear()
