"""Per-request LoRA: the stack's ``lora`` feature (config + ``apply`` -> undo) and what it leaves in the context
(``ctx.lora``, a `LoraManager`: list, load, activate).

    stack = build_stack(pipe, StackConfig(lora=LoraServingConfig(lora_dir="loras", max_loras=4)))
    stack.lora.activate([("style", 0.8)])      # the next calls add 0.8 x adapter "style"
    stack.lora.activate(None)                  # no LoRA: the bytes of the pipeline without it
    stack.lora.mode_in_use                     # "fused" / "unfused" for the active set (config.mode decides)
    stack.restore()                            # every adapter and LoRA layer gone

One module per concern: `config` (the config, a request's adapter list, the errors and their answers), `store`
(the adapters under a folder, a file read through diffusers' converter and checked against the transformer),
`manager` (resident set, LRU eviction, activation together over ranks), `slots` (hot-swap into a compiled
transformer), `fused` (a set merged into the weights from a saved copy, and the auto rule between fused and
unfused). In `features.stack.FEATURES` it sits after batch invariance (the adapters' own Linear layers get its
rule) and the parallel hooks (an adapter never wraps a hooked layer), before compile (the hot-swap slots exist
before anything is traced).
"""

from __future__ import annotations

from typing import Any, Callable

from xstage_dit.features.batch_invariance import make_invariant
from xstage_dit.features.lora.config import (AdapterError, AdapterLimit, AdapterMemory, LoraServingConfig,
                                             UnknownAdapter, adapter_list, parse_adapter_arg)
from xstage_dit.features.lora.manager import LoraManager

__all__ = ["AdapterError", "AdapterLimit", "AdapterMemory", "LoraManager", "LoraServingConfig", "UnknownAdapter",
           "adapter_list", "apply", "parse_adapter_arg"]


def apply(pipe: Any, config: LoraServingConfig, ctx) -> Callable[[], None]:
    """The stack's LoRA feature: a `LoraManager` on ``pipe.transformer`` (hot-swap slots when `config.hotswap`),
    `config.preload` loaded on every rank together; the manager goes to ``ctx.lora``. Returns its undo."""
    if not ctx.is_pipeline or not ctx.transformers:
        raise ValueError(f"expected a diffusers pipeline for LoRA (its LoRA loader), got {type(pipe).__name__}")
    manager = LoraManager(pipe, ctx.transformers[0], config,
                          make_invariant if ctx.batch_invariance is not None else None)
    try:
        for name in config.preload:
            manager.load(name)
    except BaseException:
        manager.restore()
        raise
    ctx.lora = manager
    return manager.restore
