"""The feature stack: every feature applied to a pipeline in ONE declared order, with ONE undo stack.

Each feature is a module with ``apply(pipe, config, ctx) -> undo`` (diffusers-hooks style: the undo puts back
what it changed, None when nothing was); `FEATURES` is the order, and why each sits where it does. The stack
hands every feature the `FeatureContext` (what earlier features left: the schedules, the CFG hooks, the
one-frame decode ...); no feature reads another's marker attribute. ``restore()`` runs the undos in reverse
and frees what the stack owns (the communication buffers of its groups), so the process is left as found.

    stack = build_stack(pipe, StackConfig(parallel=ParallelConfig(sp=2), compile=CompileConfig("regional")))
    pipe(prompt)                          # the patched pipeline
    stack.restore()                       # the original pipeline, and no buffer, graph or enum member left

`parallelize` is this stack with the parallel features (and the pipeline patches it always made);
`xstage_dit.engine.Engine` builds it from one `EngineConfig` for generate, serve and bench.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from xstage_dit.comm.buffers import CommBuffers
from xstage_dit.features import (attention_schedules, batch_invariance, cfg_batch, cfg_parallel, collective_safety,
                                 compile_fixes, expert_parallel, host_syncs, one_frame_vae, prompt_cache,
                                 sequence_parallel, text_depth)
from xstage_dit.features import compile as compile_feature
from xstage_dit.features import fp8, step_cache
from xstage_dit.features import lora
from xstage_dit.features.compile import CompileConfig
from xstage_dit.features.config import ParallelConfig
from xstage_dit.features.fp8 import Fp8Config
from xstage_dit.features.context import MARK, FeatureContext, modules_of
from xstage_dit.features.setup import prepare
from xstage_dit.features.step_cache import StepCacheConfig

log = logging.getLogger(__name__)

__all__ = ["FEATURES", "ORDER", "Feature", "FeatureStack", "StackConfig", "build_stack"]


@dataclass(frozen=True)
class Feature:
    """One stack feature: its name, its ``apply(pipe, config, ctx) -> undo | None``, the `StackConfig` field
    that configures it (a falsy value there: not applied) and why it sits where it does in `FEATURES`."""

    name: str
    apply: Callable[[Any, Any, FeatureContext], Callable[[], None] | None]
    config: str
    why: str


FEATURES: tuple[Feature, ...] = (
    Feature("attention_kernel", attention_schedules.apply, "parallel",
            "first: the schedules the sequence-parallel attention backend reads (ctx.schedules)"),
    Feature("expert_parallel", expert_parallel.apply, "parallel",
            "MoE layers swapped before any hook wraps them"),
    Feature("compile_fixes", compile_fixes.apply, "parallel",
            "on the MoE layers that stayed diffusers' own after expert parallelism"),
    Feature("fp8", fp8.apply, "fp8",
            "on the final linear layers (after the MoE swap), before any hook or forward replacement wraps them"),
    Feature("host_syncs", host_syncs.apply, "host_syncs",
            "before the sequence hooks: a rope cache registered first sits inside their split of its output"),
    Feature("step_cache", step_cache.apply, "cache",
            "inside the sequence hooks (a block's cache hook sees this rank's shard, after the plan's split at Wan's "
            "blocks.0 or every Qwen-Image block; its skips leave no collective half-run: the group decision) and "
            "the CFG hooks (which name the branch each forward computes); before compile, which compiles what the "
            "cache hooks call (ctx.compile_inside) and keeps the hooks' Python out of the graphs"),
    Feature("sequence_parallel", sequence_parallel.apply, "parallel",
            "split / gather hooks and the attention backend, on the swapped layers"),
    Feature("collective_safety", collective_safety.apply, "parallel",
            "outside the sequence hooks (sees the whole inputs), inside the CFG hook (one branch's inputs)"),
    Feature("cfg_parallel", cfg_parallel.apply, "parallel",
            "outermost of the parallel hooks: splits the branches before the sequence hooks"),
    Feature("cfg_batch", cfg_batch.apply, "parallel",
            "outermost hook: pairs the pipeline's two guidance calls around everything above"),
    Feature("cfg_pair_check", cfg_parallel.apply_pair_check, "parallel",
            "after every pairing hook (ctx.cfg_hooks): the VAE decode checks none is left half-paired"),
    Feature("text_depth", text_depth.apply, "text_depth",
            "inside the prompt cache: a cached embedding never runs the text encoder"),
    Feature("prompt_cache", prompt_cache.apply, "prompt_cache",
            "wraps encode_prompt around the text-depth skip"),
    Feature("one_frame_vae", one_frame_vae.apply, "one_frame_vae",
            "leaves ctx.one_frame_decode for compile"),
    Feature("batch_invariance", batch_invariance.apply, "batch_invariance",
            "after the parallel patches: a layer whose forward another patch replaced keeps it"),
    Feature("lora", lora.apply, "lora",
            "after batch invariance (the adapters' Linear layers take its rule) and the parallel hooks (no adapter "
            "wraps a hooked layer); before compile (the hot-swap slots exist before anything is traced)"),
    Feature("compile", compile_feature.apply, "compile",
            "last: traces every patch above (and compiles ctx.one_frame_decode)"),
)
ORDER: tuple[str, ...] = tuple(f.name for f in FEATURES)  # the one declared order (tests/features/test_stack.py)


@dataclass(frozen=True)
class StackConfig:
    """Which features the stack applies, and their configs (validated on construction).

    parallel: the `ParallelConfig` of the parallel features (attention kernel choice, expert / sequence / CFG
        parallelism, collective safety, compile fixes, CFG batch); None: none of them (no groups, no calibration).
    compile: a `CompileConfig` (mode "off": nothing compiles).
    fp8: an `Fp8Config` (the transformer's linear layers in float8 through torchao); None: bf16 as loaded.
    cache: a `StepCacheConfig` (one of diffusers' step caches, one decision for all ranks: `features.step_cache`);
        None: no step cache. Refused with compile mode "graphs" (a recorded forward cannot skip).
    host_syncs / text_depth / prompt_cache / one_frame_vae / batch_invariance: each feature on or off (the
        first four on, as ``parallelize`` has always applied them; batch invariance off: the engine turns it on
        for image pipelines that serve batches).
    lora: a `LoraServingConfig` (per-request LoRA adapters, `features.lora`); None: no LoRA.
    """

    parallel: ParallelConfig | None = field(default_factory=ParallelConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    host_syncs: bool = True
    text_depth: bool = True
    prompt_cache: bool = True
    one_frame_vae: bool = True
    batch_invariance: bool = False
    fp8: Fp8Config | None = None
    lora: lora.LoraServingConfig | None = None
    cache: StepCacheConfig | None = None

    def __post_init__(self) -> None:
        if self.parallel is not None and not isinstance(self.parallel, ParallelConfig):
            raise ValueError(f"expected parallel to be a ParallelConfig or None, got {type(self.parallel).__name__}")
        if not isinstance(self.compile, CompileConfig):
            raise ValueError(f"expected compile to be a CompileConfig, got {type(self.compile).__name__}")
        if self.fp8 is not None and not isinstance(self.fp8, Fp8Config):
            raise ValueError(f"expected fp8 to be an Fp8Config or None, got {type(self.fp8).__name__}")
        if self.lora is not None and not isinstance(self.lora, lora.LoraServingConfig):
            raise ValueError(f"expected lora to be a LoraServingConfig or None, got {type(self.lora).__name__}")
        if self.cache is not None and not isinstance(self.cache, StepCacheConfig):
            raise ValueError(f"expected cache to be a StepCacheConfig or None, got {type(self.cache).__name__}")
        if self.cache is not None and self.compile.mode == "graphs":
            raise ValueError(f"cache {self.cache.method} with compile mode 'graphs': a CUDA graph replays one recorded "
                             "forward and a step cache changes what a forward runs from step to step; expected "
                             "compile mode off, regional or full")
        for name in ("host_syncs", "text_depth", "prompt_cache", "one_frame_vae", "batch_invariance"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"expected {name} to be True or False, got {getattr(self, name)!r}")

    def enabled(self, feature: Feature) -> bool:
        value = getattr(self, feature.config)
        if isinstance(value, CompileConfig):
            return value.mode != "off"
        return value is not None and value is not False


# What the stack's own attributes read from its context (the public handle of `parallelize`).
_FROM_CONTEXT = ("groups", "calibration", "schedule_choices", "masked_choices", "attention_kernels", "attention_paths",
                 "num_moe_layers",
                 "cfg_hooks", "prompt_cache", "text_layers_skipped", "cfg_batch_reason", "vae_convs_2d",
                 "one_frame_decode", "batch_invariance", "compiled", "transformers", "fp8", "lora", "step_cache")


class FeatureStack:
    """What the stack applied to one pipeline, and how to undo it (``parallelize`` returns it as its handle).

    config: the ParallelConfig. groups: this rank's groups. is_output_rank: True on global rank 0 (the only
    rank that should write files). calibration: the ``ChosenParams`` the schedules use (None when the user fixed
    the schedule). schedule_choices: the ``AttentionDecision`` per distinct shape ``(batch, seq_len, heads,
    head_dim, dtype, sp)`` (``.name``: "fused:<kernel>" | "serial", ``.reason``, ``.kernel``,
    ``.kernel_reason``, the timings it rests on), filled once per shape at its first call (eager or under
    torch.compile). masked_choices: the ``KernelChoice`` per query shape ``(batch, seq_len, heads, head_dim, dtype)``
    of world-1 calls with a key-padding mask ("sdpa", "cudnn-padded" or "cudnn-fp8"). attention_kernels: the
    ``KernelChooser`` (its ``report()``). attention_paths: the attention
    paths taken ("ulysses", "local", "gather_kv") and the first module that took each. prompt_cache: the empty
    prompt's embedding kept across calls (None for a pipeline that encodes its negative prompt with the positive
    one). text_layers_skipped: `text_depth` applies. cfg_batch_reason: whether and why CFG batching runs.
    vae_convs_2d / one_frame_decode: what `one_frame_vae` patched. batch_invariance / compiled: those features'
    handles (None where not applied). applied: the features applied, in order. restore(): the pipeline and
    the process as they were (idempotent).
    """

    def __init__(self, ctx: FeatureContext) -> None:
        self.ctx = ctx
        self.applied: list[str] = []
        self._undo: list[tuple[str, Callable[[], None]]] = []

    def __getattr__(self, name: str) -> Any:
        if name in _FROM_CONTEXT:
            return getattr(self.ctx, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def config(self) -> ParallelConfig | None:
        return self.ctx.parallel

    @property
    def transformer(self) -> torch.nn.Module | None:
        """pipe.transformer (pipe.transformer_ref where only that one is loaded)."""
        return self.ctx.transformers[0] if self.ctx.transformers else None

    @property
    def cfg_hook(self) -> Any:
        """The CFG hook of pipe.transformer (None without cfg=2 or cfg_batch)."""
        return self.ctx.cfg_hooks[0] if self.ctx.cfg_hooks else None

    @property
    def is_output_rank(self) -> bool:
        return self.ctx.groups is None or self.ctx.groups.rank == 0

    @property
    def active(self) -> bool:
        return self.transformer is not None and getattr(self.transformer, MARK, None) is self

    def describe_pipeline(self) -> dict:
        """What the patches outside the transformer did so far (the server's ``/v1/calibration``)."""
        ctx, one = self.ctx, self.ctx.one_frame_decode
        batched = [dict(h.stats) for h in ctx.cfg_hooks if isinstance(h, cfg_batch.CFGBatchHook)]
        return {"cfg_batch": batched[0] if batched else None, "cfg_batch_reason": ctx.cfg_batch_reason,
                "empty_prompt_cache": ctx.prompt_cache.describe() if ctx.prompt_cache is not None else None,
                "text_layers_unread_skipped": ctx.text_layers_skipped,
                "vae_convs_2d": ctx.vae_convs_2d,
                "vae_one_frame_decode": None if one is None else {"calls": one.calls, "compiled": one.compiled}}

    def push(self, name: str, undo: Callable[[], None] | None) -> None:
        """Record `name`'s undo on the one stack (None: nothing to undo)."""
        if undo is not None:
            self._undo.append((name, undo))

    def apply_features(self, config: StackConfig, features: tuple[Feature, ...] = FEATURES) -> None:
        """Apply every enabled feature of `features` in their order, each handed its config and the context."""
        for feature in features:
            if not config.enabled(feature):
                continue
            self.push(feature.name, feature.apply(self.ctx.pipe, getattr(config, feature.config), self.ctx))
            self.applied.append(feature.name)

    def restore(self) -> None:
        """Undo every feature in reverse order, then free what the stack owns. Safe to call twice."""
        while self._undo:
            _, undo = self._undo.pop()
            undo()
        for transformer in self.ctx.transformers:
            if getattr(transformer, MARK, None) is self:
                delattr(transformer, MARK)

    def __enter__(self) -> "FeatureStack":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def build_stack(pipe: Any, config: StackConfig, features: tuple[Feature, ...] = FEATURES) -> FeatureStack:
    """Apply `config`'s features to `pipe` (a diffusers pipeline, a ModularPipeline, or a bare transformer) in the
    declared order and return the stack. With parallel features, first the ranks' agreement, the model's rules,
    the groups and the params (`setup.prepare`: errors before any GPU work), and a `CommBuffers` that the ops
    of these groups allocate into, freed on restore. On any error what was applied is undone."""
    if not isinstance(config, StackConfig):
        raise ValueError(f"expected a StackConfig, got {type(config).__name__}")
    ctx = FeatureContext(pipe=pipe, parallel=config.parallel, transformers=modules_of(pipe))
    stack = FeatureStack(ctx)
    if config.parallel is not None:
        prepare(pipe, config.parallel, ctx, {"lora": None if config.lora is None else config.lora.facts()})
        ctx.comm = CommBuffers(f"stack of {type(ctx.transformers[0]).__name__}")
        stack.push("comm_buffers", ctx.comm.free)  # the last undo: after every feature that used them
        groups = ctx.groups
        stack.push("comm_owner", ctx.comm.serve(groups.sp_group, *[g for g in [groups.cfg_group] if g is not None]))
    try:
        stack.apply_features(config, features)
    except BaseException:
        stack.restore()
        raise
    if config.parallel is not None:
        for transformer in ctx.transformers:
            setattr(transformer, MARK, stack)
    return stack
