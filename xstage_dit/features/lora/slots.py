"""Hot-swap slots: the LoRA layers a compiled transformer is traced with, whose weights and scales change in place
so that no adapter, and no scale, ever recompiles.

Before compile (the LoRA feature sits before compile in `features.stack.FEATURES`), ``max_per_request`` slot
adapters are loaded through diffusers with hot-swapping enabled (``pipe.enable_lora_hotswap(target_rank=...)``
then ``pipe.load_lora_weights(zeros, adapter_name=slot)``): every plain Linear layer of the transformer that no
other feature hooks gets a rank-``max_lora_rank`` LoRA of zeros per slot, its scale a tensor (PEFT's
``prepare_model_for_compiled_hotswap``). All slots stay active; the graphs see the same modules, shapes and
tensors for every adapter:

- an adapter goes into a slot by an in-place copy of its A and B (padded with zeros to the slot's rank; a layer
  the adapter does not target gets zeros), what PEFT's ``hotswap_adapter_from_state_dict`` does. Why not
  ``load_lora_weights(..., hotswap=True)`` itself: diffusers refuses a swap whose LoRA config differs from the
  slot's (its ``alpha_pattern`` differs as soon as the target layers or ranks differ, i.e. for nearly every pair
  of real adapters: tiny FLUX, 2026-12-07), and it re-reads and re-converts the file on every swap;
- a scale is a ``fill_`` of the slot's scale tensors (``set_adapters`` would put Python floats there, which
  Dynamo guards on: one recompile per scale);
- a slot the request does not use has scale 0 (exactly nothing added);
- a request without LoRA runs with the LoRA layers disabled (``transformer.disable_lora()``): a second graph per
  shape, compiled at warm-up, in which the layers are the plain Linear layers (no LoRA cost at all).

The adapter's own A, B and per-layer scale come from diffusers' loader (`LoraManager` loads it as a staging
adapter, takes its tensors and deletes it before any forward), so every format diffusers converts is swappable.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from xstage_dit.features.batch_invariance import is_linear
from xstage_dit.features.lora.fused import LayerAdapter
from xstage_dit.features.lora.store import base_linear, hooked

log = logging.getLogger(__name__)

__all__ = ["HotswapSlots", "harvest", "lora_layers", "patch_modules", "slot_targets"]


def lora_layers(transformer: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """name -> PEFT LoRA layer of `transformer` (modules holding ``lora_A`` / ``lora_B`` module dicts)."""
    return {name: m for name, m in transformer.named_modules()
            if isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict) and hasattr(m, "scaling")}


def slot_targets(transformer: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """Every plain Linear layer of `transformer` that no feature hooks: what a slot covers (any adapter targets a
    subset of them, or is refused by `store.read_adapter`)."""
    return [(name, m) for name, m in transformer.named_modules()
            if is_linear(m) and not hooked(m)]


class HotswapSlots:
    """`num_slots` slot adapters of rank `rank` on `pipe.transformer` (module docstring). ``holds[i]``: the adapter
    name slot i holds (None: zeros)."""

    def __init__(self, pipe: Any, transformer: torch.nn.Module, num_slots: int, rank: int) -> None:
        self.pipe, self.transformer, self.rank = pipe, transformer, rank
        self.names = [f"xstage_slot_{i}" for i in range(num_slots)]
        self.holds: list[str | None] = [None] * num_slots
        self._scale: list[float] = [0.0] * num_slots
        targets = slot_targets(transformer)
        prefix = getattr(type(pipe), "transformer_name", "transformer")
        first = next(transformer.parameters())
        for slot in self.names:
            zeros = {}
            for name, linear in targets:
                zeros[f"{prefix}.{name}.lora_A.weight"] = first.new_zeros(rank, linear.in_features)
                zeros[f"{prefix}.{name}.lora_B.weight"] = first.new_zeros(linear.out_features, rank)
            # Each slot's load pads it and turns its scales into tensors (diffusers resets the request after one
            # load, and refuses a second request once adapters exist unless told to ignore that).
            pipe.enable_lora_hotswap(target_rank=rank, check_compiled="ignore")
            pipe.load_lora_weights(zeros, adapter_name=slot)
        self.layers = lora_layers(transformer)
        self.activate_all()
        for layer in self.layers.values():
            for slot in self.names:
                layer.scaling[slot].fill_(0.0)
        # the slots' own scale of each layer, per slot: the adapter's alpha / rank, set when one is swapped in
        self._base: list[dict[str, float]] = [dict.fromkeys(self.layers, 0.0) for _ in self.names]

    def activate_all(self) -> None:
        """Every slot active on every layer, always: the graphs never see another set (cheap when already so).

        Each layer holds a list of its own: one object shared by the layers at tracing time (diffusers' loader hands
        every layer the same list) becomes an identity guard between layers (Dynamo), which a later load that gives
        the layers lists of their own fails: a recompile (tiny FLUX, 2026-12-06)."""
        layers = list(self.layers.values())
        shared = len({id(layer._active_adapter) for layer in layers}) < len(layers)  # PEFT's own attribute
        for layer in layers:
            active = layer._active_adapter  # a name (str) or a list of them
            if shared or not (isinstance(active, list) and active == self.names):
                layer.set_adapter(list(self.names))

    def modules(self) -> list[torch.nn.Module]:
        """The slots' own A and B Linear modules (what batch invariance patches)."""
        return [d[s] for layer in self.layers.values() for d in (layer.lora_A, layer.lora_B) for s in self.names]

    def put(self, index: int, name: str | None, tensors: dict[str, LayerAdapter]) -> None:
        """Copy an adapter's per-layer A (r, in) and B (out, r) (`fused.LayerAdapter`s, by layer name) into slot
        `index` (zeros where it has none); its scale stays 0 until `set_scale`."""
        slot = self.names[index]
        base = self._base[index]
        with torch.no_grad():
            for layer_name, layer in self.layers.items():
                a_slot, b_slot = layer.lora_A[slot].weight, layer.lora_B[slot].weight
                found = tensors.get(layer_name)
                a_slot.zero_()
                b_slot.zero_()
                if found is None:
                    base[layer_name] = 0.0
                    continue
                a_slot[: found.a.shape[0]].copy_(found.a)
                b_slot[:, : found.b.shape[1]].copy_(found.b)
                base[layer_name] = float(found.scale)
        self.holds[index] = name
        self._scale[index] = float("nan")  # the next set_scale writes every layer

    def set_scale(self, index: int, scale: float) -> None:
        """Slot `index` adds ``scale`` times its adapter (0: nothing); in-place fills, no recompile."""
        if self._scale[index] == scale:
            return
        slot = self.names[index]
        for layer_name, layer in self.layers.items():
            layer.scaling[slot].fill_(self._base[index][layer_name] * scale)
        self._scale[index] = scale

    def enable(self, on: bool) -> None:
        """LoRA layers on (slots added at their scales) or off (the plain Linear layers); a walk over every layer,
        so only when it changes."""
        if any(layer.disable_adapters == on for layer in self.layers.values()):
            (self.transformer.enable_lora if on else self.transformer.disable_lora)()


def harvest(transformer: torch.nn.Module, adapter: str, strict: bool = True) -> dict[str, LayerAdapter]:
    """layer name -> `fused.LayerAdapter` of PEFT adapter `adapter` as diffusers loaded it (its own tensors, not
    copies, unpadded; its alpha and rank). strict: ValueError for a LoRA with a bias or a variant (DoRA), which
    neither a slot nor a merge holds; otherwise such a layer is marked ``plain=False``."""
    out = {}
    for name, layer in lora_layers(transformer).items():
        if adapter not in layer.lora_A:
            continue
        plain = adapter not in getattr(layer, "lora_variant", {}) and layer.lora_B[adapter].bias is None
        if strict and not plain:
            raise ValueError(f"expected a plain LoRA (no DoRA, no LoRA bias) to hot-swap or fuse, got one at {name!r}")
        scale = layer.scaling[adapter]
        out[name] = LayerAdapter(a=layer.lora_A[adapter].weight.detach(), b=layer.lora_B[adapter].weight.detach(),
                                 scale=float(scale) if not isinstance(scale, torch.Tensor) else float(scale.item()),
                                 alpha=layer.lora_alpha[adapter], r=layer.r[adapter],
                                 rslora=bool(layer.use_rslora.get(adapter, False)), plain=plain)
    return out


def patch_modules(modules: list[torch.nn.Module], patch: Callable[[torch.nn.Module], Any] | None) -> None:
    """Give each module `patch` (batch invariance's rule for a Linear layer), where there is one."""
    if patch is not None:
        for module in modules:
            if type(module) is torch.nn.Linear or type(base_linear(module)) is torch.nn.Linear:
                patch(module)
