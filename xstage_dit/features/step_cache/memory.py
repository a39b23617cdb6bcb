"""TaylorSeer's state against the device's free memory, checked before it grows (`TaylorSeerMemoryCheck`).

diffusers' TaylorSeer hook keeps ``max_order + 1`` Taylor factors (bf16) of every cached attention output, per CFG
branch, for the whole call: Wan 2.1 14B at 480p x 81 frames is 80 attention layers x [32760, 5120] x 2 factors x 2
branches, about 50 GiB on top of the model, where an H100 ran out of memory mid-call. The check runs at the first
cached attention output of each branch of a request (the output's size is the call's, known only then): the state
that branch will hold (that output's bytes x factors x hooked attention layers) against what the device has free
(the driver's free memory plus the caching allocator's unused reserve). Over it, `StepCacheMemory` (507) names the
estimate and what to change, before the call has spent more than one attention layer; the handle resets every
hook's state with the request, so nothing stays behind. An estimate: activations need room too, so a call just
under it may still run out (the server's out-of-memory answer, 507, covers that).
"""

from __future__ import annotations

from typing import Any

import torch

from xstage_dit.features.device_memory import DeviceMemory
from xstage_dit.features.step_cache.config import StepCacheMemory

__all__ = ["TaylorSeerMemoryCheck"]

_FACTOR_BYTES = torch.tensor([], dtype=torch.bfloat16).element_size()  # diffusers' taylor_factors_dtype default


def _cuda_available(device: torch.device) -> int:
    return DeviceMemory.of(device).available


class TaylorSeerMemoryCheck:
    """Called with each cached attention output (`CachePoint.on_compute`); `reset` per request. layers: how many
    attention layers TaylorSeer caches; orders: factors kept per output (max_order + 1); headroom: bytes free on a
    device (default `DeviceMemory.available` on CUDA; nothing is checked on other devices unless one is given)."""

    def __init__(self, layers: int, orders: int, headroom: Any = None) -> None:
        self.layers, self.orders, self.headroom = layers, orders, headroom
        self.branch = "cond"  # set by the step cache's root hook before each transformer call
        self._checked: set[str] = set()

    def reset(self) -> None:
        self._checked.clear()

    def need_bytes(self, output: Any) -> int:
        """The state one branch will hold, from one attention layer's output (a tensor or a tuple of them)."""
        tensors = output if isinstance(output, (tuple, list)) else (output,)
        per_layer = sum(t.numel() for t in tensors if isinstance(t, torch.Tensor)) * _FACTOR_BYTES
        return per_layer * self.orders * self.layers

    def __call__(self, output: Any) -> None:
        if self.branch in self._checked:
            return
        self._checked.add(self.branch)
        first = output[0] if isinstance(output, (tuple, list)) else output
        if not isinstance(first, torch.Tensor):
            return
        headroom = self.headroom or (_cuda_available if first.device.type == "cuda" else None)
        if headroom is None:
            return  # host memory: the operating system's business, no allocator to ask
        need, free = self.need_bytes(output), headroom(first.device)
        if need > free:
            raise StepCacheMemory(
                f"cache taylorseer would keep {self.orders} factors of each of {self.layers} attention outputs of "
                f"shape {tuple(first.shape)} for the {self.branch} branch: about {need / 2**30:.1f} GiB, with "
                f"{free / 2**30:.1f} GiB free on {first.device}; ask for a smaller size or fewer frames, or use "
                "taylorseer's lite mode (--cache-lite), a lower --cache-max-order, or --cache fbcache / magcache")
