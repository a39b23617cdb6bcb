"""Fused LoRA: a request's adapters merged into the base Linear weights, ``W = W0 + sum_i delta_i``, with the LoRA
layers off during the call (the graph of a request without LoRA: no LoRA cost, no recompile), and the mode rule.

Why fused, and when (measured: ``benchmarks/results/lora/NOTES.md``): unfused LoRA layers add their two thin
matmuls to every targeted layer at every step of every request, and on a compiled full-size model that cost a
request far more than the 1.05x target; merging an adapter into the weights and putting them back costs a small
fraction of one request, so fused pays even when every request switches adapters. Its price is memory: one saved
copy ``W0`` of every targeted weight on the same device. Hence the rule of ``mode="auto"`` (`choose_mode`): fused
on a CUDA device when that copy fits beside the memory the calls need, else unfused. On the CPU auto stays unfused:
nothing was measured there, and unfused is the computation diffusers' own ``set_adapters`` runs.

Exactness: each delta is what PEFT's ``LoraLayer.get_delta_weight`` computes (peft 0.21): ``(B @ A) * scaling`` in
B's dtype, through float32 for a half-precision adapter on the CPU, ``scaling = scale * alpha / r`` (``/ sqrt(r)``
for rsLoRA) as PEFT's ``set_scale`` computes it; the deltas are added one after the other in the request's order,
as PEFT's ``merge`` adds them. So a fused image is, byte for byte, diffusers' ``set_adapters`` + ``fuse_lora``
image. Switching A -> B writes ``W0 + delta_B`` straight into the weight from the saved copy; no adapter copies
``W0`` back (bit-exact, unlike subtracting the delta again).

    weights = FusedWeights(transformer)
    weights.write((("a", 0.8),), {"a": harvest(transformer, "a")})   # W = W0 + 0.8-scaled delta of a
    weights.write((), {})                                            # W0 again, bit for bit
    weights.restore()                                                # and the saved copies freed
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

from xstage_dit.features.device_memory import DeviceMemory
from xstage_dit.features.lora.config import MODES
from xstage_dit.features.lora.store import base_linear

__all__ = ["FusedWeights", "LayerAdapter", "choose_mode", "delta_weight", "headroom"]

# Fragmentation margin of the auto rule, as a fraction of the device's memory (see `headroom`).
FRAGMENTATION_MARGIN = 1 / 32


@dataclass(frozen=True)
class LayerAdapter:
    """One adapter on one layer, as diffusers/PEFT loaded it: a (r, in_features), b (out_features, r), the layer's
    scaling at adapter scale 1 (``scale``), PEFT's ``alpha`` / ``r`` / ``rslora`` (what `scaling` computes from),
    ``plain``: no LoRA bias and no variant (DoRA), which are the only adapters merged here."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    alpha: float
    r: int
    rslora: bool = False
    plain: bool = True

    def scaling(self, scale: float) -> float:
        """PEFT's ``LoraLayer.set_scale``: the layer's scaling for adapter scale `scale`, in its operation order."""
        if self.rslora:
            return scale * self.alpha / math.sqrt(self.r)
        return scale * self.alpha / self.r


def delta_weight(layer: LayerAdapter, scale: float) -> torch.Tensor:
    """PEFT's ``Linear.get_delta_weight`` at adapter scale `scale`: ``(B @ A) * scaling``, (out_features,
    in_features) in B's dtype; a half-precision adapter on the CPU is multiplied in float32 and cast back. The same
    bytes as PEFT's, in fewer passes over memory (what a switch costs on a large model)."""
    a, b = layer.a, layer.b
    dtype = b.dtype
    cast = b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
    if cast:
        a, b = a.float(), b.float()
    out = b @ a
    scaling = layer.scaling(scale)
    if scaling != 1.0:  # x * 1.0 is x, bit for bit: a pass over the weight's size saved (alpha = rank, scale 1)
        out.mul_(scaling)  # in place: the same rounding as PEFT's `* scaling`, one temporary fewer
    return out.to(dtype=dtype) if cast else out


def headroom(memory: DeviceMemory) -> int:
    """Bytes the saved copy must leave free: the largest call seen so far (after the warm-up the cached memory is
    mostly what its activations left; a copy taken from it would make the next call of that size run out of
    memory), plus `FRAGMENTATION_MARGIN` of the device, because the caching allocator carves blocks out of segments
    and reuses a free block only for a request it fits, so not every free byte serves a call's allocation pattern
    (a margin, not a measurement)."""
    return memory.peak_extra + int(memory.total * FRAGMENTATION_MARGIN)


def choose_mode(mode: str, device_type: str, copy_bytes: int, memory: DeviceMemory | None,
                plain: bool = True) -> tuple[str, str]:
    """("fused" or "unfused", why) for a request's adapter set. mode: the configured one (`MODES`); copy_bytes:
    the saved copies this set would add (0: held already); memory: the device's (`DeviceMemory.of`; only read for
    CUDA and auto); plain: every adapter of the set is a plain LoRA (A, B)."""
    if mode not in MODES:
        raise ValueError(f"expected a LoRA mode in {', '.join(MODES)}, got {mode!r}")
    if mode != "auto":
        return mode, f"mode {mode}"
    if not plain:
        return "unfused", "an adapter of the set has a LoRA bias or variant (only plain LoRAs are merged)"
    if device_type != "cuda":
        return "unfused", (f"on {device_type}: fused is measured to pay on CUDA devices; unfused is the computation "
                           f"diffusers' set_adapters runs")
    if copy_bytes == 0:
        return "fused", "the saved copies of the targeted weights are held already"
    if memory is None:
        raise ValueError("expected the device's memory for the auto rule on a CUDA device, got None")
    room = memory.available - headroom(memory)
    mib = 2 ** 20
    if copy_bytes <= room:
        return "fused", f"the saved copy of the targeted weights ({copy_bytes / mib:.0f} MiB) fits ({room / mib:.0f} MiB)"
    return "unfused", (f"the saved copy of the targeted weights ({copy_bytes / mib:.0f} MiB) does not fit beside the "
                       f"largest call's memory and a margin ({max(room, 0) / mib:.0f} MiB left)")


class FusedWeights:
    """The merged state of `transformer`'s LoRA-targeted weights: ``saved`` (layer name -> W0, allocated at the
    layer's first merge, on the weight's device), ``merged`` (the adapter set the weights hold, ``((name, scale),
    ...)``; () when every weight is W0). Layer names are those of `transformer`'s modules (a PEFT LoRA layer or the
    Linear it wraps: the same name)."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.transformer = transformer
        self.saved: dict[str, torch.Tensor] = {}
        self.merged: tuple[tuple[str, float], ...] = ()
        self._state: dict[str, tuple] = {}  # layer -> its ((adapter, scale), ...) now; absent: W0
        self._plan: dict[str, list] = {}  # the last plan written in full (what a failed write goes back to)

    def _weight(self, layer: str) -> torch.Tensor:
        return base_linear(self.transformer.get_submodule(layer)).weight

    def copy_bytes(self, layers: Iterable[str]) -> int:
        """Bytes of the saved copies a merge of `layers` would allocate (0: all held)."""
        return sum(self._weight(name).nbytes for name in set(layers) if name not in self.saved)

    def write(self, wanted: Iterable[tuple[str, float]], adapters: dict[str, dict[str, LayerAdapter]]) -> None:
        """Make the weights ``W0 + sum`` of the deltas of `wanted` (``((name, scale), ...)``, summed in that order;
        `adapters`: name -> layer -> `LayerAdapter`); layers no adapter targets go back to W0. Only layers whose
        set changes are written. On any error every weight is put back as it was (copies this call allocated are
        freed) and the error raised."""
        wanted = tuple(wanted)
        plan: dict[str, list] = {}
        for name, scale in wanted:
            for layer, lora in adapters[name].items():
                plan.setdefault(layer, []).append((name, scale, lora))
        before = set(self.saved)
        try:
            self._write(plan)
        except BaseException:
            self._write(self._plan)
            self.drop_copies(keep=before)
            raise
        self._plan, self.merged = plan, wanted

    def _write(self, plan: dict[str, list]) -> None:
        with torch.no_grad():
            for layer in sorted(set(plan) | set(self._state)):
                terms = plan.get(layer, [])
                key = tuple((name, scale) for name, scale, _ in terms)
                if self._state.get(layer, ()) == key:
                    continue
                weight = self._weight(layer)
                saved = self.saved.get(layer)
                if saved is None:
                    saved = self.saved[layer] = weight.detach().clone()  # W0, at the layer's first merge
                if not terms:
                    weight.copy_(saved)
                    del self._state[layer]
                    continue
                self._state[layer] = ("<being written>",)  # a failure below leaves it marked for the rewrite
                for i, (_, scale, lora) in enumerate(terms):
                    delta = delta_weight(lora, scale)
                    if i == 0:
                        torch.add(saved, delta, out=weight)  # W0 + delta_1: PEFT's `weight += delta` on W0
                    else:
                        weight += delta
                self._state[layer] = key

    def drop_copies(self, keep: set[str]) -> None:
        """Free the saved copies not in `keep` of layers that hold W0 (what a failed switch allocated)."""
        for layer in [name for name in self.saved if name not in keep and name not in self._state]:
            del self.saved[layer]

    def restore(self) -> None:
        """Every merged weight back to W0 (bit for bit) and every saved copy freed."""
        self._write({})
        self._plan, self.merged = {}, ()
        self.saved.clear()
