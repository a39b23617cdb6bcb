"""Copies from host memory that stall a DiT forward, taken out of it (`parallelize` applies, `restore` undoes).

Why: a copy from pageable host memory to the GPU first waits for the stream (CUDA's rule for
``cudaMemcpyAsync`` from pageable memory), so each one drains the GPU's queue, and in a host-bound call the
GPU then idles while the host prepares what follows. One compiled NucleusMoE 4-step call on the H200 spent
610 ms of host time against 387 ms of GPU work, 56 ms of it in 100 ``cudaMemcpyAsync`` calls
(`benchmarks/results/serving/served-path-nucleusmoe-h200-f6c8114-profile-bare-warm-guards.txt`). diffusers
0.42's NucleusMoE forward makes four such copies per forward (three when the prompt comes without a padding
mask, as the pipeline passes it when no token is padding), each recomputing the same values:

- ``NucleusMoEEmbedRope.pos_freqs`` / ``neg_freqs`` are plain attributes, not buffers: ``pipe.to("cuda")``
  leaves them on the CPU and every forward copies the 2 MB table (``self.pos_freqs.to(device)``);
- its forward makes ``torch.tensor(height // 2, device=...)`` and ``torch.tensor(width // 2, device=...)``;
- ``_compute_text_seq_len_from_mask`` makes ``torch.as_tensor(text_seq_len, device=...)`` for a per-sample
  length the transformer's forward drops.

Here: the rope tables move to the rope module's device once; the rope module's outputs are cached per (image
shapes, text length, device, inference mode) by a diffusers hook registered before the sequence-parallel ones
(their split of the image frequencies sees the whole table, as before); ``_compute_text_seq_len_from_mask``
is swapped for the same computation with its fallback length made on the device
(`_diffusers_private.text_seq_len_without_host_copy`). Outputs are the same bits (tests/features/test_host_syncs.py,
which also counts the host-to-device copies per forward on the meta device: four before, none after; on the GPU
it compares under torch's deterministic mode, since diffusers' expert combine, a CUDA ``scatter_add``, is not
deterministic by itself). Measured on an H100 (14951cd): a compiled 4-step NucleusMoE call made 36
``cudaMemcpyAsync`` calls, against 100 before (f6c8114, H200).
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable

import torch
from diffusers.hooks import HookRegistry, ModelHook

from xstage_dit import _diffusers_private as private
from xstage_dit.families.registry import rope_host_sync_classes
from xstage_dit.features.context import chained
from xstage_dit.features.instance_attr import remove_hook

log = logging.getLogger(__name__)

ROPE_CACHE_ENTRIES = 16  # (image size, text length) pairs kept: a server's warm-up sizes times CFG's two lengths
_HOOK = "xstage-rope-cache"
_TABLES = ("pos_freqs", "neg_freqs")


class RopeCacheHook(ModelHook):
    """Returns a rope module's earlier output for the same (image shapes, device, text length, inference mode).

    Only without autograd (an inference tensor may not be saved for backward) and outside torch.compile's
    tracing (Dynamo traces the module itself). ``hits`` / ``misses`` count the eager calls."""

    def __init__(self, entries: int = ROPE_CACHE_ENTRIES) -> None:
        super().__init__()
        self.entries = entries
        self.cache: collections.OrderedDict = collections.OrderedDict()
        self.hits = self.misses = 0

    def new_forward(self, module, *args, **kwargs):
        forward = self.fn_ref.original_forward
        if torch.compiler.is_compiling() or torch.is_grad_enabled():
            return forward(*args, **kwargs)
        key = _rope_key(*args, **kwargs)
        if key in self.cache:
            self.hits += 1
            self.cache.move_to_end(key)
            return self.cache[key]
        self.misses += 1
        out = forward(*args, **kwargs)
        self.cache[key] = out
        if len(self.cache) > self.entries:
            self.cache.popitem(last=False)
        return out


def _rope_key(video_fhw: Any, device: Any = None, max_txt_seq_len: Any = None) -> tuple:
    """NucleusMoEEmbedRope.forward's arguments as a hashable key (its outputs depend on nothing else)."""
    if isinstance(max_txt_seq_len, torch.Tensor):
        max_txt_seq_len = int(max_txt_seq_len)  # a 0-d tensor: its value, as the forward reads it
    return repr(video_fhw), str(device), max_txt_seq_len, torch.is_inference_mode_enabled()


def remove_host_copies(transformer: torch.nn.Module) -> tuple[Callable[[], None], int]:
    """Take the per-forward host-to-device copies out of `transformer` (see the module docstring): rope tables
    moved to their module's device, rope outputs cached, the text-length helper swapped. Returns (undo, rope
    modules changed). A transformer without such modules is left alone (0)."""
    classes = rope_host_sync_classes()  # NucleusMoE's NucleusMoEEmbedRope (its family record)
    ropes = [m for m in transformer.modules() if type(m).__name__ in classes
             and all(isinstance(getattr(m, t, None), torch.Tensor) for t in _TABLES)]
    if not ropes:
        return (lambda: None), 0
    # The device the weights live on (not meta: experts a rank never materialises stay there, `models.experts`).
    placed = next((p for p in transformer.parameters() if p.device.type != "meta"), None)
    device = placed.device if placed is not None else getattr(ropes[0], _TABLES[0]).device
    undo: list[Callable[[], None]] = []
    for rope in ropes:
        tables = {t: getattr(rope, t) for t in _TABLES}
        for name, table in tables.items():
            setattr(rope, name, table.to(device))
        registry = HookRegistry.check_if_exists_or_initialize(rope)
        registry.register_hook(RopeCacheHook(), _HOOK)

        def restore(rope=rope, tables=tables) -> None:
            remove_hook(rope, _HOOK)
            for name, table in tables.items():
                setattr(rope, name, table)

        undo.append(restore)
    undo.append(private.text_seq_len_without_host_copy())
    log.info("host copies: %d NucleusMoE rope module(s) keep their tables on %s and cache their outputs; the "
             "text-length helper fills on the device (4 host-to-device copies a forward less)", len(ropes), device)

    def undo_all() -> None:
        while undo:
            undo.pop()()

    return undo_all, len(ropes)


def apply(pipe, enabled: bool, ctx) -> Callable[[], None] | None:
    """The stack's host-sync fixes: `remove_host_copies` on each transformer. Before sequence parallelism: a rope
    cache registered first sits inside the sequence hooks' split of its output."""
    return chained(remove_host_copies(transformer)[0] for transformer in ctx.transformers)
