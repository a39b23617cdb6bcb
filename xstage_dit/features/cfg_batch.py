"""CFG's two forwards a step as one batch on the same ranks (``ParallelConfig(cfg_batch=True | "auto")``).

Why: NucleusMoE's pipeline calls the transformer twice a step, the prompt then ``""``, with the same latents,
and its compiled call is host-bound (f6c8114 on the H200: 610 ms of host time against 387 ms of GPU work, 8
forwards a 4-step call). One forward on the pair as a batch of two halves the forwards, and so the host time
each costs, while the GPU work stays about the same: the call moves toward its GPU bound. Expert-choice routing
picks tokens per sample, so batching does not change it; the two texts are padded to one length with the
padding masked out. On the tiny NucleusMoE (CPU, float32) the batched outputs equal the two separate ones to
9.5e-7 (outputs up to 2.5). Measured (NucleusMoE 1024², 4 steps, H100, b3a1445, one run): 0.601 against 0.667 s
eager, 0.387 against 0.414 s compiled whole; the commands run it by default (``--cfg-batch auto``), the library
only when asked (``ParallelConfig`` defaults to False).

How (as `cfg_parallel`'s paired hook, on one rank group): the first call of a step returns a placeholder tensor
and keeps its inputs; the second (the pipeline holds the placeholder and reads it only after that call) runs the
batch, fills the placeholder with the first half and returns the second. The placeholder takes the shape and
dtype the family record's ``facts.cfg_batch_output_like`` predicts from the call's inputs (NucleusMoE: its image
tokens through ``proj_out``; checked on every filled pair), so even a call's first pair runs batched: a warm-up of
one step compiles the batched graph, and the graphs of one sample are never needed. Where the record predicts
nothing, the first pair of each input shape runs both calls plainly, to learn the output's shape. Pairing is armed
only while the pipeline's own guidance is on (``facts.cfg_batch_guidance``: NucleusMoE sets
``pipe._guidance_scale``), so a call without CFG runs plainly; inputs that cannot
be stacked (different latents, arguments other than the text) run the two forwards one after the other, the same
values as without this. A placeholder left unfilled (a loop that did not come in pairs) raises RuntimeError at
the next call or before the VAE decodes.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch
import torch.nn.functional as F
from diffusers.hooks import HookRegistry, ModelHook

from xstage_dit.families.registry import record_for_pipeline, record_for_transformer, records
from xstage_dit import _diffusers_private as private
from xstage_dit.features.cfg_parallel import _sample, _wrap_like
from xstage_dit.features.compile import signature_of
from xstage_dit.features.context import COND_CONTEXT, PAIR_CONTEXT, chained
from xstage_dit.features.instance_attr import remove_hook

log = logging.getLogger(__name__)

__all__ = ["CFGBatchHook", "batching_pipelines", "batching_transformers", "guidance_of", "output_like_of",
           "text_inputs_of", "apply"]


# What CFG batching reads from a family record (`FeatureFacts`): the pipeline's guidance switch, the transformer's
# text input and its padding mask (padded to one length to stack the pair), its output's shape before the call.

def guidance_of(pipe) -> Callable[[Any], bool] | None:
    """pipe -> whether its current call runs CFG (two transformer calls a step), or None where not known."""
    record = record_for_pipeline(pipe)
    return record.facts.cfg_batch_guidance if record is not None else None


def text_inputs_of(transformer) -> tuple[str, str] | None:
    """(its text input, that input's padding mask), or None where CFG batching does not know the transformer."""
    record = record_for_transformer(transformer)
    return record.facts.cfg_batch_text_inputs if record is not None else None


def output_like_of(transformer) -> Callable[[torch.nn.Module, dict], tuple | None] | None:
    """(module, call kwargs) -> the output sample's (shape, dtype, device) before the call runs (the placeholder is
    made from it), or None to learn it from a plain first pair."""
    record = record_for_transformer(transformer)
    return record.facts.cfg_batch_output_like if record is not None else None


def batching_pipelines() -> list[str]:
    """The pipeline classes CFG batching knows (their record's facts say when guidance is on)."""
    return sorted(p for r in records().values() if r.facts.cfg_batch_guidance is not None for p in r.pipelines)


def batching_transformers() -> list[str]:
    """The transformer classes CFG batching knows (their record names the text input to pad)."""
    return sorted(t for r in records().values() if r.facts.cfg_batch_text_inputs is not None for t in r.transformers)


class CFGBatchHook(ModelHook):
    """Runs a step's (cond, uncond) transformer calls as one batch (module docstring).

    stats: {"batched_pairs", "plain_pairs" (learning a shape, or inputs that do not stack), "plain_calls"
    (guidance off)}."""

    outside_compile = True  # its pairing state is Python's: apply_compile compiles what it calls, not it
    _is_stateful = True  # so diffusers' cache_context() reaches its tracker: the batch runs under PAIR_CONTEXT

    def __init__(self, guidance_on: Callable[[], bool], text: str, text_mask: str,
                 output_like: Callable[[torch.nn.Module, dict], tuple | None] | None = None) -> None:
        super().__init__()
        self.tracker = private.context_tracker()
        self.guidance_on = guidance_on
        self.text, self.text_mask = text, text_mask
        self.output_like = output_like
        self.output_shapes: dict[tuple, tuple] = {}
        self.pending: tuple[dict, torch.Tensor | None] | None = None
        self.stats = {"batched_pairs": 0, "plain_pairs": 0, "plain_calls": 0}

    def reset_state(self, module):
        return module  # a pair left half-made is `check_no_pending`'s to report, not a reset's to hide

    def check_no_pending(self, where: str) -> None:
        if self.pending is not None and self.pending[1] is not None:
            self.pending = None
            raise RuntimeError(f"CFG batching: a conditional transformer call was left without its unconditional "
                               f"partner before {where}; the pipeline's loop does not call the transformer in pairs")

    # Not traced when the whole transformer compiles (its pairing state is Python's); what it calls still is.
    @torch.compiler.disable(recursive=False)
    def new_forward(self, module, *args, **kwargs):
        forward = self.fn_ref.original_forward
        if args or torch.is_grad_enabled() or not self.guidance_on():
            self.check_no_pending("a call without guidance")
            self.stats["plain_calls"] += 1
            return forward(*args, **kwargs)
        if self.pending is None:
            key = signature_of((), kwargs)
            shape = self.output_shapes.get(key)
            if shape is None and self.output_like is not None:
                shape = self.output_like(module, kwargs)
            if shape is None:  # the first pair of this shape: run plainly, learn the output's shape
                out = forward(**kwargs)
                sample = _sample(out)
                self.output_shapes[key] = (tuple(sample.shape), sample.dtype, sample.device)
                self.pending = (kwargs, None)
                return out
            size, dtype, device = shape
            placeholder = torch.empty(size, dtype=dtype, device=device)
            self.pending = (kwargs, placeholder)
            return _wrap_like(_template(kwargs), placeholder)
        first, placeholder = self.pending
        self.pending = None
        if placeholder is None:
            self.stats["plain_pairs"] += 1
            return forward(**kwargs)
        batched = self._stacked(first, kwargs)
        if batched is None:  # not stackable: the two forwards one after the other, as without batching
            with private.branch_context(module, COND_CONTEXT, self.tracker):
                _fill(placeholder, _sample(forward(**first)))
            self.stats["plain_pairs"] += 1
            return forward(**kwargs)
        with private.branch_context(module, PAIR_CONTEXT, self.tracker):  # a cache's state holds both, cond first
            out = forward(**batched)
        sample = _sample(out)
        n = placeholder.shape[0]
        _fill(placeholder, sample[:n])
        self.stats["batched_pairs"] += 1
        return _wrap_like(out, sample[n:])

    def _stacked(self, first: dict, second: dict) -> dict | None:
        """The two calls' inputs as one batch, or None where they differ in more than the text."""
        if first.keys() != second.keys() or first.get("hidden_states") is not second.get("hidden_states"):
            return None
        out = {}
        text_len = max(first[self.text].shape[1], second[self.text].shape[1])
        for name, a in first.items():
            b = second[name]
            if name == self.text:
                out[name] = torch.cat([_pad_tokens(a, text_len), _pad_tokens(b, text_len)])
            elif name == self.text_mask:
                out[name] = torch.cat([_mask(a, first[self.text], text_len), _mask(b, second[self.text], text_len)])
            elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() > 0 and a.shape == b.shape:
                out[name] = torch.cat([a, b])  # per-sample inputs: latents, timesteps
            elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b) == first["hidden_states"].shape[0]:
                out[name] = a + b  # per-sample lists (NucleusMoE's img_shapes)
            elif a is b or (not isinstance(a, torch.Tensor) and a == b):
                out[name] = a
            else:
                return None
        return out


def _fill(placeholder: torch.Tensor, sample: torch.Tensor) -> None:
    """The conditional call's output into the placeholder the pipeline holds, which must match it exactly (a wrong
    ``cfg_batch_output_like`` prediction would otherwise broadcast or cast silently)."""
    if sample.shape != placeholder.shape or sample.dtype != placeholder.dtype:
        raise RuntimeError(f"CFG batching: expected the conditional output of shape {tuple(placeholder.shape)} and "
                           f"dtype {placeholder.dtype}, got {tuple(sample.shape)} and {sample.dtype}")
    placeholder.copy_(sample)


def _template(kwargs: dict) -> Any:
    """What the transformer returns for these kwargs, for `_wrap_like`: a tuple unless return_dict."""
    return None if kwargs.get("return_dict", True) else ()


def _pad_tokens(x: torch.Tensor, length: int) -> torch.Tensor:
    return x if x.shape[1] == length else F.pad(x, (0, 0, 0, length - x.shape[1]))


def _mask(mask: torch.Tensor | None, text: torch.Tensor, length: int) -> torch.Tensor:
    """The text's padding mask at `length` tokens (a missing mask: every token real; the padding added: masked)."""
    if mask is None:
        mask = torch.ones(text.shape[:2], dtype=torch.long, device=text.device)
    return mask if mask.shape[1] == length else F.pad(mask, (0, length - mask.shape[1]))


# Where CFG batching was measured (the reason "auto" turns it on): the log points there, not at its numbers.
MEASURED_IN = "benchmarks/results/e2e/nucleusmoe-compilefull-1xh100-b3a1445.md"
_HOOK = "xstage-cfg-batch"


def apply(pipe, config, ctx) -> Callable[[], None] | None:
    """The stack's CFG batching (``ParallelConfig.cfg_batch``): each transformer's two guidance calls a step as
    one batch (`CFGBatchHook`), armed while the pipeline's guidance is on; registered outermost (after CFG
    parallel). "auto": the same where it applies, else nothing; the reason either way in
    ``ctx.cfg_batch_reason`` and the log. The hooks go to ``ctx.cfg_hooks``."""
    if config.cfg_batch is False:
        return None
    guidance = guidance_of(pipe)
    if config.cfg_batch == "auto":
        unknown = sorted({type(t).__name__ for t in ctx.transformers if text_inputs_of(t) is None})
        why_not = (f"CFG parallel (cfg={config.cfg}) runs the two calls on two rank groups" if config.cfg != 1 else
                   f"CFG batching does not know {type(pipe).__name__}" if guidance is None else
                   f"CFG batching does not know {', '.join(unknown)}" if unknown else None)
        ctx.cfg_batch_reason = (f"off (cfg_batch=auto): {why_not}" if why_not else
                                f"on (cfg_batch=auto): a step's two guidance calls as one batch of two (measured "
                                f"faster: {MEASURED_IN})")
        log.info("CFG batching %s", ctx.cfg_batch_reason)
        if why_not:
            return None
    elif guidance is None:
        raise ValueError(f"expected a pipeline CFG batching knows ({', '.join(batching_pipelines())}) with "
                         f"cfg_batch=True, got {type(pipe).__name__}")
    else:
        ctx.cfg_batch_reason = "on (cfg_batch=True)"
    undos = []
    for transformer in ctx.transformers:
        hook = CFGBatchHook(lambda: guidance(pipe), *text_inputs_of(transformer),
                            output_like=output_like_of(transformer))
        registry = HookRegistry.check_if_exists_or_initialize(transformer)
        registry.register_hook(hook, _HOOK)
        ctx.cfg_hooks.append(hook)
        undos.append(functools.partial(remove_hook, transformer, _HOOK))
    return chained(undos)
