"""`cache_empty_prompts(pipe)`: the empty prompt's text embedding computed once, not on every CFG call.

Why: a pipeline whose ``encode_prompt`` encodes one list of prompts (NucleusMoE, Qwen-Image, Qwen-Image 2.1,
HunyuanImage 2.1, HunyuanVideo 1.5, FLUX with true CFG) calls it twice on a guided call, the second time for
the negative prompt, which is ``""`` whenever the user gave none (NucleusMoE's ``negative_prompt = [""] *
batch_size``). NucleusMoE's text encoder is Qwen3-VL-8B: 36 eager decoder layers a pass (72 text-encoder
attention calls in the H200 profile of one compiled 4-step call, two passes; the call is host-bound, so each
eager layer's launches sit on its critical path). The embedding of ``""`` depends only on the weights, the
tokenizer and the call's other arguments, so it is kept per argument set and handed back as a copy.

Kept only for calls whose every prompt string is ``""`` and that pass no tensor (a user's own prompt is
always encoded: the benchmarks' repeated prompt stays a fair comparison with diffusers), outside autograd
and autocast. Every use first compares a fingerprint of the text encoders (each parameter's and buffer's
storage and in-place version, PEFT LoRA layers' scales and active adapters, the tokenizer objects), so weights
loaded, moved, cast or adapted afterwards are seen and encoded again. Pipelines whose ``encode_prompt`` takes
the negative prompt itself (Wan, LTX, CogVideoX, SD3, Z-Image, ...) are left alone: their second prompt is
encoded inside the same call.

    cache = cache_empty_prompts(pipe)   # None where the pipeline's encode_prompt takes no single prompt list
    pipe(prompt, guidance_scale=4.0)    # encodes prompt and ""; the next call encodes prompt alone
    cache.hits, cache.misses            # calls served from the cache / encoded
    cache.restore()
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
from typing import Any, Callable

import torch

from xstage_dit.features.compile import clone_tensors
from xstage_dit.features.instance_attr import set_on_instance

log = logging.getLogger(__name__)

__all__ = ["PromptCache", "cache_empty_prompts", "DEFAULT_ENTRIES", "apply"]

DEFAULT_ENTRIES = 8  # argument sets kept: batch sizes of "" times devices, typically one or two
_ENCODER_PREFIXES = ("text_encoder", "tokenizer", "processor")


class PromptCache:
    """``pipe.encode_prompt`` wrapped so an all-``""`` call returns its earlier result (cloned tensors).

    hits / misses: the all-``""`` calls answered from the cache / encoded (others are not counted).
    restore(): the pipeline's own ``encode_prompt`` again (idempotent)."""

    def __init__(self, pipe: Any, entries: int = DEFAULT_ENTRIES) -> None:
        if entries < 1:
            raise ValueError(f"expected entries >= 1, got {entries}")
        self.pipe = pipe
        self.entries = entries
        self.hits = self.misses = 0
        self._encode = pipe.encode_prompt  # the bound method this wraps
        self._signature = inspect.signature(self._encode)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._unwrap = set_on_instance(pipe, "encode_prompt", self)

    def __call__(self, *args, **kwargs):
        key = self._key(args, kwargs)
        if key is None:
            return self._encode(*args, **kwargs)
        fingerprint = _fingerprint(self.pipe)
        entry = self._cache.get(key)
        if entry is not None and entry[0] == fingerprint:
            self._cache.move_to_end(key)
            self.hits += 1
            return clone_tensors(entry[1])  # the pipeline may modify what it gets back
        result = self._encode(*args, **kwargs)
        self.misses += 1
        self._cache[key] = (fingerprint, result)
        self._cache.move_to_end(key)
        while len(self._cache) > self.entries:
            self._cache.popitem(last=False)
        return clone_tensors(result)

    def _key(self, args: tuple, kwargs: dict) -> tuple | None:
        """The call's arguments as a hashable key, or None where the call is not cacheable."""
        if torch.is_grad_enabled() or torch.is_autocast_enabled():
            return None
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError:
            return None  # the pipeline's own call raises its own error
        bound.apply_defaults()
        prompts = []
        items = []
        for name, value in bound.arguments.items():
            if self._signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                value = tuple(sorted(value.items()))
            elif self._signature.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL:
                value = tuple(value)
            if "prompt" in name and _strings(value) is not None:
                prompts.extend(_strings(value))
                value = (type(value).__name__, tuple(_strings(value)))
            frozen = _frozen(value)
            if frozen is _UNCACHEABLE:
                return None
            items.append((name, frozen))
        if not prompts or any(p != "" for p in prompts):
            return None
        return (torch.is_inference_mode_enabled(), *items)

    def clear(self) -> None:
        """Drop every kept embedding (the fingerprint makes this unnecessary after a weight change)."""
        self._cache.clear()

    def restore(self) -> None:
        self._unwrap()
        self._cache.clear()

    def describe(self) -> dict:
        return {"entries": len(self._cache), "hits": self.hits, "misses": self.misses}


def cache_empty_prompts(pipe: Any, entries: int = DEFAULT_ENTRIES) -> PromptCache | None:
    """Wrap ``pipe.encode_prompt`` in a `PromptCache` where it encodes one prompt list (no ``negative_prompt``
    parameter: the pipeline calls it again for the negative prompt); None for other pipelines (and for a bare
    transformer or a pipeline without ``encode_prompt``)."""
    encode = getattr(pipe, "encode_prompt", None)
    if not callable(encode) or isinstance(encode, PromptCache):
        return None
    try:
        parameters = inspect.signature(encode).parameters
    except (TypeError, ValueError):
        return None
    if "prompt" not in parameters or "negative_prompt" in parameters:
        return None
    cache = PromptCache(pipe, entries)
    log.info("%s: the empty prompt's embedding is kept after its first encoding (CFG's default negative prompt)",
             type(pipe).__name__)
    return cache


_UNCACHEABLE = object()


def _strings(value: Any) -> list[str] | None:
    """value as a list of strings if it is a string or a non-empty list / tuple of them, else None."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def _frozen(value: Any) -> Any:
    """A hashable stand-in that compares equal exactly when the argument is the same; `_UNCACHEABLE` for
    tensors (a caller's own embeddings) and for values that cannot be compared by value."""
    if isinstance(value, torch.Tensor):
        return _UNCACHEABLE
    if isinstance(value, (list, tuple)):
        parts = tuple(_frozen(v) for v in value)
        return _UNCACHEABLE if any(p is _UNCACHEABLE for p in parts) else (type(value).__name__, parts)
    if value is None or isinstance(value, (str, int, float, bool, torch.device, torch.dtype)):
        return (type(value).__name__, value)
    return _UNCACHEABLE


def _fingerprint(pipe: Any) -> tuple:
    """What the empty prompt's embedding depends on besides the call's arguments: per text-encoder component,
    every parameter's and buffer's (storage pointer, in-place version, dtype) and PEFT layers' adapter state;
    tokenizers and processors by identity."""
    parts: list = []
    components = getattr(pipe, "components", None) or {}
    for name in sorted(components):
        component = components[name]
        if component is None or not name.startswith(_ENCODER_PREFIXES):
            continue
        if not isinstance(component, torch.nn.Module):
            parts.append((name, id(component)))
            continue
        parts.append(name)
        for module in component.modules():
            # Runs on every cached call, on ~850 modules for Qwen3-VL-8B: the instance dict read directly, since a
            # missed attribute costs nn.Module.__getattr__'s raised AttributeError (a third of the time, measured).
            attrs = vars(module)
            for tensors in (attrs["_parameters"], attrs["_buffers"]):
                for tensor in tensors.values():
                    if tensor is not None:
                        parts.append((tensor.data_ptr(), tensor._version, tensor.dtype))
            if "merged_adapters" in attrs or _is_tuner_class(type(module)):
                # a PEFT tuner layer: LoRA scales change its output
                parts.append((_frozen_dict(getattr(module, "scaling", {})), tuple(module.active_adapters),
                              bool(getattr(module, "disable_adapters", False)), tuple(module.merged_adapters)))
    return tuple(parts)


@functools.cache
def _is_tuner_class(cls: type) -> bool:
    """PEFT's ``BaseTunerLayer`` declares ``merged_adapters`` on the class (its layers also set it per instance)."""
    return hasattr(cls, "merged_adapters")


def _frozen_dict(value: Any) -> Any:
    return tuple(sorted(value.items())) if isinstance(value, dict) else value


def apply(pipe: Any, enabled: bool, ctx) -> Callable[[], None] | None:
    """The stack's prompt cache: `cache_empty_prompts` on a pipeline (not a bare transformer); the cache in
    ``ctx.prompt_cache`` (None where the pipeline encodes its negative prompt with the positive one)."""
    ctx.prompt_cache = cache_empty_prompts(pipe) if ctx.is_pipeline else None
    return None if ctx.prompt_cache is None else ctx.prompt_cache.restore
