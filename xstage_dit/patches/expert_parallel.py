"""Expert parallelism: swap a transformer's MoE layers for the EP layers of `xstage_dit.ops.moe.combine`.

EP shares the ranks of the sequence-parallel group: each EP layer receives this rank's sequence shard
and holds ``num_experts / ep`` experts (``from_layer`` copies only this rank's experts). The original
layers are kept for `undo`, moved to the CPU while patched so only the rank's experts occupy the GPU.

A pipeline loaded with ``load_pipeline(..., expert_shard=(rank, ep))`` already holds EP layers with only
this rank's experts: they are not swapped but bound to the group (their shard must be the group's
(rank, size): ValueError otherwise), and `undo` unbinds them. It does not gather the other ranks' experts:
after ``restore()`` the pipeline is as loaded, and running it without `parallelize` raises RuntimeError.
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
        raise RuntimeError(f"expected the EP layer {path} (xstage_dit.ops.moe.combine), got {exc!r}") from exc


def _device_of(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def apply_expert_parallel(model: torch.nn.Module, moe_layers, group) -> tuple[Callable[[], None], int]:
    """Replace every module whose class name is in `moe_layers` by its EP layer over `group`.

    moe_layers: ((diffusers class name, "module:EPClass"), ...). Returns (undo, number replaced).
    """
    classes = {name: path for name, path in moe_layers}
    ep_classes = {path.partition(":")[2] for path in classes.values()}
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Module, torch.device]] = []
    bound: list[torch.nn.Module] = []
    try:
        for parent_name, parent in list(model.named_modules()):
            for child_name, child in list(parent.named_children()):
                if type(child).__name__ in ep_classes and hasattr(child, "bind"):
                    if getattr(child, "bound", True):
                        raise RuntimeError(
                            f"expected the {type(child).__name__} at {parent_name}.{child_name} to be a loaded shard "
                            "(from_shard), got a layer already bound to a group (parallelized by someone else?)"
                        )
                    child.bind(group)  # ValueError unless the group's (rank, size) is the loaded shard
                    bound.append(child)
                    continue
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
        _undo(swapped, bound)
        raise
    if classes and not swapped and not bound:
        log.warning("expert parallel: no %s layer found in %s", "/".join(classes), type(model).__name__)
    if bound:
        log.info("expert parallel: %d MoE layers were loaded sharded (shard %s): bound to the group, not swapped",
                 len(bound), bound[0].shard)

    def undo() -> None:
        _undo(swapped, bound)

    return undo, len(swapped) + len(bound)


def loaded_shards(model: torch.nn.Module) -> set[tuple[int, int]]:
    """The (rank, world) shards of the EP layers a sharded load put in `model` (empty for a full model)."""
    return {m.shard for m in model.modules() if hasattr(m, "bind") and hasattr(m, "shard") and not m.bound}


def check_loaded_shards(model: torch.nn.Module, ep: int) -> None:
    """A pipeline loaded with expert_shard=(r, w), w > 1, runs only with ep == w (ValueError otherwise)."""
    worlds = {w for _, w in loaded_shards(model) if w > 1}
    if len(worlds) > 1:
        raise ValueError(f"expected the MoE layers of {type(model).__name__} loaded for one expert-shard world, got {sorted(worlds)}")
    if worlds and ep not in worlds:
        w = worlds.pop()
        raise ValueError(f"expected ep={w} for a pipeline loaded with expert_shard=(rank, {w}), got ep={ep}")


def _undo(swapped, bound) -> None:
    for parent, child_name, original, device in reversed(swapped):
        setattr(parent, child_name, original.to(device))
    swapped.clear()
    for layer in bound:
        layer.unbind()
    bound.clear()
