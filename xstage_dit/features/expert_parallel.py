"""Expert parallelism: swap a transformer's MoE layers for the EP layers of `xstage_dit.features.ep_layers`.

EP shares the ranks of the sequence-parallel group: each EP layer receives this rank's sequence shard
and holds ``num_experts / ep`` experts (``from_layer`` copies only this rank's experts). The original
layers are kept for `undo`, their own tensors moved to the CPU while patched (the router and shared expert, which
the EP layer shares, stay where they are), so only the rank's experts occupy the GPU.
Every EP layer of a model shares one ``MoEScheduler`` fed the X-Stage params ``parallelize`` hands down
(``xparams``): the path and lead are chosen once per layer shape, logged once, and readable on each
layer as ``layer.schedule_choice``.

World 1 (a group of one rank): `schedule.moe.choose_moe_world1` decides per layer kind, on the EP class's
``routing`` fact, and the reason is logged. "auto" keeps diffusers' layer for both kinds, as measured on the
H200: expert choice (NucleusMoE), whose EP world-1 path runs the fused kernel with no host plan, lost to
diffusers' layer compiled with `compile_fixes` at both of its shapes; top-k (HiDream) would need the general
EP plan, whose host sync outweighed the faster kernel.
``apply_expert_parallel(world1_path=...)`` forces an EP path ("fused", "serial", "reference") either way.

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

from xstage_dit.comm.distributed import world_of
from xstage_dit.features.context import chained
from xstage_dit.schedule.facts import DeviceFacts
from xstage_dit.schedule.moe import MoEScheduler, choose_moe_world1

log = logging.getLogger(__name__)


def _ep_class(path: str):
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(f"expected the EP layer {path} (xstage_dit.features.ep_layers), got {exc!r}") from exc


def _device_of(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def _num_experts(layer: torch.nn.Module) -> int:
    # NucleusMoELayer has num_experts; HiDream's MOEFeedForwardSwiGLU a ModuleList of experts.
    num = getattr(layer, "num_experts", None)
    return int(num) if num is not None else len(layer.experts)


def _world1_path(child: torch.nn.Module, routing: str, where: str, seen: set, requested: str) -> str | None:
    """World 1: the EP layer path `choose_moe_world1` picks for `child`, or None (keep diffusers' layer).

    routing: the EP class's ``routing`` ("expert_choice" | "top_k"), the fact the choice turns on."""
    facts = DeviceFacts.from_device(_device_of(child))
    experts = _num_experts(child)
    choice = choose_moe_world1(facts, num_experts=experts, routing=routing, requested=requested)
    key = (type(child).__name__, experts, facts)
    if key not in seen:  # one line per layer shape, not per layer
        seen.add(key)
        action = "diffusers' layer kept" if choice.name == "diffusers" else "EP layer (world 1)"
        log.info("expert parallel at world 1: %s with %d experts (first at %s): %s -> %s (%s)",
                 type(child).__name__, experts, where, choice.name, action, choice.reason)
    return None if choice.name == "diffusers" else choice.name


def apply_expert_parallel(model: torch.nn.Module, moe_layers, group, *, xparams=None,
                          world1_path: str = "auto") -> tuple[Callable[[], None], int]:
    """Replace every module whose class name is in `moe_layers` by its EP layer over `group`.

    moe_layers: ((diffusers class name, "module:EPClass"), ...). xparams: the calibrated X-Stage params of
    the group's target (``params_for(...).params``) or None; they feed the layers' shared ``MoEScheduler``.
    At world 1 ``world1_path`` "auto" lets `schedule.moe.choose_moe_world1` decide per layer kind (today:
    diffusers' layer stays, as measured); "fused", "serial" or "reference" swaps in the EP layer on that path.
    Returns (undo, number replaced or bound).
    """
    classes = {name: path for name, path in moe_layers}
    ep_classes = {path.partition(":")[2] for path in classes.values()}
    _, world = world_of(group)
    scheduler = MoEScheduler(xparams)
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Module, torch.device]] = []
    bound: list[torch.nn.Module] = []
    kept: set = set()
    try:
        for parent_name, parent in list(model.named_modules()):
            for child_name, child in list(parent.named_children()):
                if type(child).__name__ in ep_classes and hasattr(child, "bind"):
                    if getattr(child, "bound", True):
                        raise RuntimeError(
                            f"expected the {type(child).__name__} at {parent_name}.{child_name} to be a loaded shard "
                            "(from_shard), got a layer already bound to a group (parallelized by someone else?)"
                        )
                    child.bind(group, scheduler)  # ValueError unless the group's (rank, size) is the loaded shard
                    bound.append(child)
                    continue
                path = classes.get(type(child).__name__)
                if path is None:
                    continue
                ep_cls = _ep_class(path)
                kwargs = {}
                if world == 1:
                    ep_path = _world1_path(child, ep_cls.routing, f"{parent_name}.{child_name}", kept, world1_path)
                    if ep_path is None:
                        continue
                    kwargs["path"] = ep_path
                ep_layer = ep_cls.from_layer(child, group, scheduler=scheduler, **kwargs)
                device = _device_of(child)
                setattr(parent, child_name, ep_layer)
                if device.type != "cpu":
                    _offload_unshared(child, ep_layer)
                swapped.append((parent, child_name, child, device))
    except BaseException:
        _undo(swapped, bound)
        raise
    if classes and not swapped and not bound and not kept:
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


def _offload_unshared(original: torch.nn.Module, ep_layer: torch.nn.Module) -> None:
    """Move the original layer's tensors to the CPU while it waits for `undo`, except those the EP layer
    shares with it (the router and the shared expert run on, in place): moving the whole module would take
    them off the GPU under the EP layer's feet."""
    # Shared by storage, not by object: at world 1 the EP layer wraps the original's expert tensors in
    # Parameters of its own (patches.ep_layers), and moving those would copy ~30 GB to the host for nothing.
    shared = {t.untyped_storage().data_ptr() for t in (*ep_layer.parameters(), *ep_layer.buffers())}
    for module in original.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.untyped_storage().data_ptr() not in shared:
                param.data = param.data.to("cpu")
        for name, buf in module.named_buffers(recurse=False):
            if buf.untyped_storage().data_ptr() not in shared:
                module._buffers[name] = buf.to("cpu")


def _undo(swapped, bound) -> None:
    for parent, child_name, original, device in reversed(swapped):
        setattr(parent, child_name, original.to(device))
    swapped.clear()
    for layer in bound:
        layer.unbind()
    bound.clear()


def apply(pipe, config, ctx) -> Callable[[], None] | None:
    """The stack's expert parallelism: ep > 1, every MoE layer of each transformer becomes an EP layer over the
    sp group; at world 1 only where the MoE chooser runs the fused kernel (NucleusMoE on a GPU), the others
    stay diffusers' own, with the reason logged. Counts the layers in ``ctx.num_moe_layers``."""
    undos = []
    for transformer, plan in zip(ctx.transformers, ctx.plans):
        if config.ep > 1 or (ctx.groups.world_size == 1 and plan.moe_layers):
            xparams = ctx.calibration.params if ctx.calibration is not None else None
            undo, num_moe = apply_expert_parallel(transformer, plan.moe_layers, ctx.groups.sp_group, xparams=xparams)
            ctx.num_moe_layers += num_moe
            undos.append(undo)
    return chained(undos)
