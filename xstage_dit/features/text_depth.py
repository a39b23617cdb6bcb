"""`skip_unread_layers(pipe)`: a text encoder's decoder layers past the deepest hidden state the pipeline reads are
not run (`parallelize` applies it, `restore` undoes it).

Why: some pipelines take their prompt embedding from an inner layer of an LLM text encoder and never read what
comes after it. NucleusMoE reads ``hidden_states[-8]`` of Qwen3-VL-8B (``return_index``, default -8): the output
of layer 29 of 36, so 7 layers (19 % of a pass) compute what nobody reads; FLUX.2 stacks layers 10, 20 and 30 of
Mistral-Small's 40 (``text_encoder_out_layers``): 10 layers unread (25 %). A pass of the full-size Qwen3-VL text
model dispatches 2538 aten ops (counted on the meta device, 80 tokens), each an eager launch on the critical path
of NucleusMoE's host-bound call.

How: during ``encode_prompt``, the unread layers' ``forward`` returns its input unchanged. The hidden-state tuple
keeps its length (transformers records each layer's output through hooks that still run), so every index the
pipeline reads, counted from either end, names the same tensor as before, computed by the same layers: the
embeddings are the same bits (tests/features/test_text_depth.py). The depth comes from the call's own arguments,
so a caller asking for another index gets the layers it needs.

    undo = skip_unread_layers(pipe)   # None where the pipeline reads the last layer (or its record says nothing)
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable

import torch

from xstage_dit.families.registry import record_for_pipeline
from xstage_dit.features.instance_attr import set_on_instance

log = logging.getLogger(__name__)

__all__ = ["llm_decoder", "skip_unread_layers", "layers_needed", "apply"]


def layers_needed(indices: list[int], num_layers: int) -> int:
    """How many of `num_layers` decoder layers produce ``hidden_states[i]`` for every i in `indices` (the tuple
    holds the embeddings, then each layer's output: ``num_layers + 1`` entries). `num_layers` where the last
    entry is read (it may be the final norm's output) or an index is out of range (the pipeline's own error)."""
    needed = 0
    for index in indices:
        position = index + num_layers + 1 if index < 0 else index
        if not 0 <= position < num_layers:
            return num_layers
        needed = max(needed, position)
    return needed


def llm_decoder(text_encoder: Any) -> torch.nn.Module | None:
    """The language model of a text encoder that is a decoder LLM (``get_decoder()`` with a ``layers`` list:
    Qwen3-VL, Qwen2.5-VL, Mistral, Gemma); None for T5 / CLIP encoders and anything else."""
    if not isinstance(text_encoder, torch.nn.Module) or not hasattr(text_encoder, "get_decoder"):
        return None
    decoder = text_encoder.get_decoder()
    is_llm = isinstance(decoder, torch.nn.Module) and isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList)
    return decoder if is_llm else None


def _decoder_layers(text_encoder: Any) -> torch.nn.ModuleList | None:
    decoder = llm_decoder(text_encoder)
    return decoder.layers if decoder is not None and len(decoder.layers) > 0 else None


def _identity(hidden_states, *args, **kwargs):
    return hidden_states


def skip_unread_layers(pipe: Any) -> Callable[[], None] | None:
    """Wrap ``pipe.encode_prompt`` so the text encoder's decoder layers past the deepest index it reads do not run
    (module docstring). Returns the undo, or None where the pipeline's family record has no
    ``facts.text_read_indices`` (the hidden-state indices its encode_prompt reads, from the call's bound
    arguments) or its text encoder has no decoder layer list."""
    record = record_for_pipeline(pipe)
    reads = record.facts.text_read_indices if record is not None else None
    encoder = getattr(pipe, "text_encoder", None)
    layers = _decoder_layers(encoder) if reads is not None else None
    if layers is None or not callable(getattr(pipe, "encode_prompt", None)):
        return None
    encode = pipe.encode_prompt
    signature = inspect.signature(encode)

    @functools.wraps(encode)
    def encode_prompt(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return encode(*args, **kwargs)  # the pipeline's own error
        bound.apply_defaults()
        needed = layers_needed(reads(pipe, bound.arguments), len(layers))
        undo_skips = [set_on_instance(layer, "forward", _identity) for layer in list(layers)[needed:]]
        try:
            return encode(*args, **kwargs)
        finally:
            for undo_skip in reversed(undo_skips):
                undo_skip()

    undo = set_on_instance(pipe, "encode_prompt", encode_prompt)
    log.info("%s: text encoder layers past the deepest hidden state read are skipped (%d layers)",
             type(pipe).__name__, len(layers))
    return undo


def apply(pipe: Any, enabled: bool, ctx) -> Callable[[], None] | None:
    """The stack's text depth: `skip_unread_layers` on a pipeline (not a bare transformer); whether it applies in
    ``ctx.text_layers_skipped``. Before the prompt cache: a cached embedding never runs it."""
    undo = skip_unread_layers(pipe) if ctx.is_pipeline else None
    ctx.text_layers_skipped = undo is not None
    return undo
