"""`parallelize(pipe, ParallelConfig(...))`: sequence, expert and CFG parallelism for a diffusers pipeline.

    import xstage_dit
    handle = xstage_dit.parallelize(pipe, xstage_dit.ParallelConfig(sp=4))   # under torchrun, 4 ranks
    image = pipe(prompt, generator=torch.Generator().manual_seed(0)).images[0]
    if handle.is_output_rank: image.save("out.png")
    handle.restore()                                                         # the original pipeline again

One module per concern: `config` (ParallelConfig), `groups` (process groups), `sharding` (the split
rule), `sequence_parallel` + `attention_backend` + `processors` + `sdpa_processors` (Ulysses),
`attention_schedules` (the schedule per shape, from the params `calibration.params_for` gives once),
`expert_parallel` (EP MoE layers), `cfg_parallel` (guidance branches), `plans` (a transformer's plan, from its
family record in `xstage_dit.families`: subclasses resolve to their family),
`collective_safety` (agreement and failures across ranks), `host_syncs` (host copies out of the forward),
`prompt_cache` (CFG's empty negative prompt encoded once), `text_depth` (a text encoder's unread layers not
run), `one_frame_vae` (a video VAE's one-frame decode as a 2-D network), `_diffusers_private` (the only user of
private diffusers API). Calling `parallelize` on an already parallelized pipeline is an error
(RuntimeError): restore it first.

Never a hang (issue 18): before any other collective the ranks compare their configuration, model
classes and weight shapes (`RanksDisagree` on every rank if they differ); a validation error on one
rank is raised on all (`RankFailed`, also of the original builtin kind: ``except ValueError`` works);
each eager forward compares a fingerprint of the inputs first (differently seeded generators fail on
every rank instead of giving an image no single process makes; ``ParallelConfig(check_inputs=False)``
skips it); an exception inside a forward is published to the peers, whose gloo collectives stop with
the same error at once. After such a forward failure the process group is not reusable: exit.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from xstage_dit.calibration.provider import ChosenParams, params_for
from xstage_dit.features.config import ParallelConfig
from xstage_dit.features.groups import ParallelGroups
from xstage_dit.features.instance_attr import set_on_instance
from xstage_dit.schedule.facts import DeviceFacts

log = logging.getLogger(__name__)

__all__ = ["parallelize", "check_degrees", "ParallelConfig", "ParallelHandle", "supported_models"]

_MARK = "_xstage_parallel_handle"


@dataclass
class ParallelHandle:
    """What `parallelize` did, and how to undo it.

    config / groups: the configuration and this rank's groups. is_output_rank: True on global rank 0
    (the only rank that should write files). calibration: the ``ChosenParams`` the schedules use (None
    when the user fixed the schedule). schedule_choices: the ``AttentionDecision`` per distinct shape
    ``(batch, seq_len, heads, head_dim, dtype, sp)`` (``.name``: "fused:<kernel>" | "serial", ``.reason``,
    ``.kernel``, ``.kernel_reason``, the timings it rests on), filled once per shape at its first call (eager or
    under torch.compile; both reasons are logged then). attention_kernels: the ``KernelChooser`` (its
    ``report()``: the kernel sweep's families, source and cache file). attention_paths: the attention paths taken ("ulysses",
    "local", "gather_kv") and the first module that took each. prompt_cache: the empty prompt's embedding kept
    across calls (`prompt_cache.PromptCache`: hits, misses), None for a pipeline that encodes its negative prompt
    with the positive one. text_layers_skipped: `text_depth` applies. cfg_batch_reason: whether and why CFG
    batching runs ("" where the config turned it off). vae_convs_2d / one_frame_decode: what `one_frame_vae` patched in the VAE
    (`describe_pipeline()` reports both and the cache). restore(): puts the pipeline back exactly (idempotent).
    """

    config: ParallelConfig
    groups: ParallelGroups
    transformer: torch.nn.Module  # pipe.transformer (pipe.transformer_ref where only that one is loaded)
    transformers: list = field(default_factory=list)  # every patched one (Wan 2.2 A14B: + transformer_2)
    calibration: ChosenParams | None = None
    schedule_choices: dict = field(default_factory=dict)
    attention_kernels: Any = None
    attention_paths: dict = field(default_factory=dict)
    num_moe_layers: int = 0
    cfg_hooks: list = field(default_factory=list)  # the CFG hooks (.stats count parallel pairs / split calls)
    prompt_cache: Any = None  # the empty prompt's kept embedding (`prompt_cache.PromptCache`), None where not kept
    text_layers_skipped: bool = False  # the text encoder's unread layers are not run (`text_depth`)
    cfg_batch_reason: str = ""  # whether and why CFG batching runs (`cfg_batch`)
    vae_convs_2d: int = 0  # the VAE's causal 3-D convolutions that run a one-frame input as 2-D (`one_frame_vae`)
    one_frame_decode: Any = None  # the VAE's `one_frame_vae.OneFrameDecode` (None for other VAEs)
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def cfg_hook(self) -> Any:
        """The CFG hook of pipe.transformer (None without cfg=2 or cfg_batch)."""
        return self.cfg_hooks[0] if self.cfg_hooks else None

    @property
    def is_output_rank(self) -> bool:
        return self.groups.rank == 0

    @property
    def active(self) -> bool:
        return getattr(self.transformer, _MARK, None) is self

    def describe_pipeline(self) -> dict:
        """What the patches outside the transformer did so far (the server's ``/v1/calibration``)."""
        from xstage_dit.features.cfg_batch import CFGBatchHook

        one = self.one_frame_decode
        batched = [dict(h.stats) for h in self.cfg_hooks if isinstance(h, CFGBatchHook)]
        return {"cfg_batch": batched[0] if batched else None, "cfg_batch_reason": self.cfg_batch_reason,
                "empty_prompt_cache": self.prompt_cache.describe() if self.prompt_cache is not None else None,
                "text_layers_unread_skipped": self.text_layers_skipped,
                "vae_convs_2d": self.vae_convs_2d,
                "vae_one_frame_decode": None if one is None else {"calls": one.calls, "compiled": one.compiled}}

    def restore(self) -> None:
        """Undo every patch (reverse order). Safe to call twice."""
        while self._undo:
            self._undo.pop()()
        for t in self.transformers or [self.transformer]:
            if getattr(t, _MARK, None) is self:
                delattr(t, _MARK)

    def __enter__(self) -> "ParallelHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def supported_models():
    """The transformers `parallelize` supports (see `plans.supported_models_markdown`)."""
    from xstage_dit.features.plans import supported_models as _supported

    return _supported()


# The components a pipeline's denoise loop calls: pipe.transformer; pipe.transformer_2, a second expert (Wan 2.2
# A14B); pipe.transformer_ref, the ref2va checkpoint partition of MiniMax-H3's modular pipeline (one repository,
# two transformers; a workflow loads only its own, so either may be None).
_DENOISERS = ("transformer", "transformer_2", "transformer_ref")


def _transformers_of(pipe: Any) -> list[torch.nn.Module]:
    """Every denoiser component of `pipe` that is loaded (`_DENOISERS`, in that order), or [pipe] for a bare
    transformer. A diffusers ModularPipeline exposes its components as attributes, so it is taken like a
    DiffusionPipeline."""
    found = [m for m in (getattr(pipe, name, None) for name in _DENOISERS) if isinstance(m, torch.nn.Module)]
    if found:
        return found
    if isinstance(pipe, torch.nn.Module):
        return [pipe]  # a bare transformer
    raise ValueError(f"expected a diffusers pipeline with a .transformer (a DiT pipeline), got {type(pipe).__name__}")


def _modules_of(pipe: Any) -> list[torch.nn.Module]:
    """The transformers of `pipe` without raising (what the ranks compare before validating)."""
    try:
        return _transformers_of(pipe)
    except ValueError:
        return []


def _ensure_process_group(config: ParallelConfig) -> None:
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from xstage_dit.comm.distributed import init_distributed

        init_distributed(timeout_s=config.timeout_s)


def _calibrated_params(config: ParallelConfig, groups: ParallelGroups) -> ChosenParams | None:
    """The X-Stage params the attention schedules use, from the one provider (collective: every rank)."""
    if config.schedule != "auto":
        log.info("attention schedule fixed by the user: %s (no calibration needed)", config.schedule)
        return None
    chosen = params_for(groups.device, groups.sp_group, allow_measure=config.calibrate)
    log.info("X-Stage params for the attention schedules (%s): %s",
             "measured on a cache miss" if config.calibrate else "cache only, calibrate=False", chosen.describe())
    return chosen


def check_degrees(transformer: torch.nn.Module, config: ParallelConfig):
    """The model's own rules for `config` (its plan's check, ep only with MoE layers, cfg only where CFG
    applies, enough heads for sp); ValueError naming the rule. Returns the transformer's `ModelPlan`.
    Touches no process group, so it also runs on a meta-device transformer (the CLI's pre-check test)."""
    from xstage_dit.features.plans import plan_for
    from xstage_dit.features.sequence_parallel import check_heads

    plan = plan_for(transformer)
    if plan.check is not None:
        plan.check(transformer, config)
    if config.cfg_batch is True:  # "auto" turns itself off where it does not apply (`_cfg_batch`)
        from xstage_dit.features.cfg_batch import batching_transformers, text_inputs_of

        if text_inputs_of(transformer) is None:
            raise ValueError(f"expected cfg_batch=False for {type(transformer).__name__} (CFG batching knows "
                             f"{', '.join(batching_transformers())}), got cfg_batch=True")
    if config.ep > 1 and not plan.moe_layers:
        raise ValueError(f"expected ep=1 for {type(transformer).__name__} (no MoE layers to shard), got ep={config.ep}")
    if config.cfg > 1 and plan.cfg is None:
        raise ValueError(f"expected cfg=1: CFG parallel does not apply to {type(transformer).__name__}, got cfg={config.cfg}")
    check_heads(transformer, config.sp)
    return plan


def parallelize(pipe: Any, config: ParallelConfig | None = None, **degrees: Any) -> ParallelHandle:
    """Make `pipe` (a diffusers DiT pipeline, a ModularPipeline such as MiniMax-H3's, or a bare transformer)
    run on `sp * cfg` ranks. Every loaded denoiser component is patched: ``pipe.transformer``, and
    ``pipe.transformer_2`` (Wan 2.2 A14B) or ``pipe.transformer_ref`` (MiniMax-H3's ref2va partition) where present.

    config: a ParallelConfig, or its fields as keyword arguments (``parallelize(pipe, sp=4)``).
    Call on every rank after loading the same weights (torchrun, or ``xstage-dit generate --sp N``).
    Errors, raised before any GPU work: ValueError for degrees that do not multiply to the world
    size, a head count sp cannot split, ep > 1 on a model without MoE layers, cfg=2 where CFG does
    not apply, an unsupported transformer, or a processor that bypasses dispatch_attention_fn
    (named); RuntimeError if `pipe` is already parallelized. At world > 1 every rank raises the same
    error: `RanksDisagree` (a ValueError) when the ranks passed different configurations, model
    classes or weight shapes, `RankFailed` (of the first failing rank's kind) when one rank failed.
    Returns a `ParallelHandle`; ``handle.restore()`` gives back the original pipeline.
    """
    if config is None:
        config = ParallelConfig(**degrees)
    elif degrees:
        raise ValueError(f"expected either a ParallelConfig or keyword degrees, got both ({sorted(degrees)})")
    if not isinstance(config, ParallelConfig):
        raise ValueError(f"expected a ParallelConfig, got {type(config).__name__}")

    from xstage_dit.comm.agreement import check_agreement, fail_together
    from xstage_dit import _diffusers_private as private
    from xstage_dit.features.collective_safety import setup_facts
    from xstage_dit.features.plans import plan_for

    _ensure_process_group(config)
    world = dist.get_world_size() if dist.is_initialized() else 1
    # Before any collective that depends on them, every rank checks the others passed the same
    # configuration, model classes and weight shapes (one all-gather), then validates locally; an error
    # on one rank becomes the same error on all (one more all-gather), so none is left in new_group().
    check_agreement(setup_facts(config, _modules_of(pipe)), what="parallelize")
    with fail_together(what="parallelize"):
        private.check_diffusers_version()
        transformers = _transformers_of(pipe)
        plans = []
        for transformer in transformers:
            if getattr(transformer, _MARK, None) is not None:
                raise RuntimeError(
                    "expected a pipeline that is not parallelized yet, got one already patched: call restore() first"
                )
            if plan_for(transformer).moe_layers:
                from xstage_dit.features.expert_parallel import check_loaded_shards

                check_loaded_shards(transformer, config.ep)  # loaded with expert_shard=(r, w): ep must be w
            plans.append(check_degrees(transformer, config))
        config.check_world(world)

    from xstage_dit.features.groups import build_groups

    groups = build_groups(config)
    chosen = _calibrated_params(config, groups)
    handle = ParallelHandle(config=config, groups=groups, transformer=transformers[0], transformers=transformers,
                            calibration=chosen)
    # Imported here, not at the top: it pulls in the attention op (and torch._dynamo through its
    # assume_constant_result), which the CLI's pre-checks of a ParallelConfig must not pay for.
    from xstage_dit.features.attention_kernels import KernelChooser
    from xstage_dit.features.attention_schedules import AttentionSchedules

    if config.schedule == "auto":
        handle.attention_kernels = KernelChooser(world=config.sp, group=groups.sp_group,
                                                 allow_measure=config.calibrate)
    schedules = AttentionSchedules(config.schedule, world=config.sp, facts=DeviceFacts.from_device(groups.device),
                                   xparams=chosen.params if chosen else None, source=chosen.source if chosen else "",
                                   kernels=handle.attention_kernels, choices=handle.schedule_choices,
                                   paths=handle.attention_paths)
    try:
        for transformer, plan in zip(transformers, plans):
            _apply(transformer, plan, handle, schedules)
        _cfg_batch(pipe, handle)
        _check_cfg_pairs_before_decode(pipe, handle)
        _pipeline_patches(pipe, handle)
    except BaseException:
        handle.restore()
        raise
    for transformer in transformers:
        setattr(transformer, _MARK, handle)
        _log_layer_shapes(transformer, handle)
    log.info(
        "parallelize %s: world=%d sp=%d ep=%d cfg=%d (rank %d: cfg branch %d, shard %d), %d MoE layers on EP",
        " + ".join(type(t).__name__ for t in transformers), world, config.sp, config.ep, config.cfg, groups.rank,
        groups.cfg_rank, groups.sp_rank, handle.num_moe_layers,
    )
    return handle


def _log_layer_shapes(transformer, handle: ParallelHandle) -> None:
    """One startup line per distinct attention / MoE layer shape. The schedule itself depends on the
    token count, known at the first call: each (shape, tokens) decision is logged once, with its reason."""
    from xstage_dit.families.registry import moe_layer_classes

    attn, moe = {}, {}
    moe_classes = moe_layer_classes()
    for name, module in transformer.named_modules():
        heads = getattr(module, "heads", None)
        if heads is not None and getattr(module, "processor", None) is not None:
            inner = getattr(module, "inner_dim", None)
            key = (heads, inner // heads if inner else None)
            attn.setdefault(key, []).append(name)
        if hasattr(module, "num_experts_per_rank") or type(module).__name__ in moe_classes:
            key = (type(module).__name__, getattr(module, "hidden_size", None), getattr(module, "num_experts", None))
            moe.setdefault(key, []).append(name)
    calibrated = ("calibrated" if handle.calibration is not None and handle.calibration.params is not None
                  else "uncalibrated (no X-Stage params)")
    for (heads, head_dim), names in attn.items():
        log.info("attention shape heads=%s head_dim=%s (%d layers, sp=%d): schedule %s, %s design test at the first "
                 "call per token count", heads, head_dim, len(names), handle.config.sp, handle.config.schedule, calibrated)
    for (cls, hidden, experts), names in moe.items():
        log.info("MoE shape %s hidden=%s experts=%s (%d layers, ep=%d): combine order chosen by the EP layer per token "
                 "count (%s)", cls, hidden, experts, len(names), handle.config.ep, calibrated)


def _apply(transformer, plan, handle: ParallelHandle, schedules: "AttentionSchedules") -> None:  # noqa: F821
    from diffusers.hooks import HookRegistry

    from xstage_dit.features.cfg_parallel import BatchedCFGHook, PairedCFGHook
    from xstage_dit.features.compile_fixes import fix_grouped_mm_offsets
    from xstage_dit.features.expert_parallel import apply_expert_parallel
    from xstage_dit.features.host_syncs import remove_host_copies
    from xstage_dit.features.sequence_parallel import apply_sequence_parallel

    config, groups = handle.config, handle.groups
    # ep > 1: every MoE layer becomes an EP layer. World 1: only where the MoE chooser runs the fused
    # kernel (NucleusMoE on a GPU); the others stay diffusers' own, with the reason logged.
    if config.ep > 1 or (groups.world_size == 1 and plan.moe_layers):
        xparams = handle.calibration.params if handle.calibration is not None else None
        undo_ep, num_moe = apply_expert_parallel(transformer, plan.moe_layers, groups.sp_group, xparams=xparams)
        handle.num_moe_layers += num_moe
        handle._undo.append(undo_ep)
    # MoE layers that stay diffusers' own (ep = 1) get the torch.compile work-around of compile_fixes.
    handle._undo.append(fix_grouped_mm_offsets(transformer)[0])
    # Before the sequence hooks: a rope cache registered first sits inside their split of its output.
    handle._undo.append(remove_host_copies(transformer)[0])

    spec = plan.build_sp(transformer)
    handle._undo.append(
        apply_sequence_parallel(
            transformer, spec, group=groups.sp_group, rank=groups.sp_rank, world=config.sp, schedules=schedules,
        )
    )

    if groups.sp_group is not None and config.sp > 1:
        # outside the sequence hooks (sees the whole inputs), inside the CFG hook (one branch's inputs)
        from xstage_dit.features.collective_safety import CollectiveSafetyHook

        registry = HookRegistry.check_if_exists_or_initialize(transformer)
        registry.register_hook(CollectiveSafetyHook(groups.sp_group, type(transformer), config.check_inputs),
                               "xstage-safety")
        handle._undo.append(lambda: registry.remove_hook("xstage-safety", recurse=False))

    if config.cfg > 1:
        registry = HookRegistry.check_if_exists_or_initialize(transformer)
        name = "xstage-cfg"
        if plan.cfg == "batched":
            hook = BatchedCFGHook(groups.cfg_group, groups.cfg_rank, plan.cfg_batch_dims, type(transformer))
        else:
            hook = PairedCFGHook(groups.cfg_group, groups.cfg_rank)
        handle.cfg_hooks.append(hook)
        registry.register_hook(hook, name)  # registered last = outermost: splits before the sequence hooks
        handle._undo.append(lambda: registry.remove_hook(name, recurse=False))


def _pipeline_patches(pipe, handle: ParallelHandle) -> None:
    """Outside the transformer: the text encoder's layers past the deepest hidden state read not run
    (`text_depth`); CFG's default negative prompt ("") encoded once, not every call (`prompt_cache`); a video
    VAE's one-frame decode as a 2-D network without the frame cache (`one_frame_vae`)."""
    from xstage_dit.features.one_frame_vae import one_frame_convs_as_2d, one_frame_decode, one_frame_decode_of
    from xstage_dit.features.prompt_cache import cache_empty_prompts
    from xstage_dit.features.text_depth import skip_unread_layers

    if isinstance(pipe, torch.nn.Module):
        return  # a bare transformer: no text encoder or VAE here
    undo_depth = skip_unread_layers(pipe)  # inside the prompt cache: a cached embedding never runs it
    handle.text_layers_skipped = undo_depth is not None
    if undo_depth is not None:
        handle._undo.append(undo_depth)
    handle.prompt_cache = cache_empty_prompts(pipe)
    if handle.prompt_cache is not None:
        handle._undo.append(handle.prompt_cache.restore)
    vae = getattr(pipe, "vae", None)
    if isinstance(vae, torch.nn.Module):
        undo, handle.vae_convs_2d = one_frame_convs_as_2d(vae)
        handle._undo.append(undo)
        # A VAE shared with a pipeline parallelized before (diffusers' from_pipe shares components) keeps that
        # pipeline's wrapping, which its handle undoes.
        handle.one_frame_decode = one_frame_decode_of(vae)
        if handle.one_frame_decode is None:
            handle.one_frame_decode = one_frame_decode(vae)
            if handle.one_frame_decode is not None:
                handle._undo.append(handle.one_frame_decode.restore)


def _cfg_batch(pipe, handle: ParallelHandle) -> None:
    """``cfg_batch``: each transformer's two guidance calls a step as one batch (`cfg_batch`), armed while the
    pipeline's guidance is on; registered outermost. "auto": the same where it applies, else nothing; the
    reason either way in ``handle.cfg_batch_reason`` and the log."""
    if handle.config.cfg_batch is False:
        return
    from diffusers.hooks import HookRegistry

    from xstage_dit.features.cfg_batch import (CFGBatchHook, batching_pipelines, guidance_of, output_like_of,
                                               text_inputs_of)

    guidance = guidance_of(pipe)
    if handle.config.cfg_batch == "auto":
        unknown = sorted({type(t).__name__ for t in handle.transformers if text_inputs_of(t) is None})
        why_not = (f"CFG parallel (cfg={handle.config.cfg}) runs the two calls on two rank groups"
                   if handle.config.cfg != 1 else
                   f"CFG batching does not know {type(pipe).__name__}" if guidance is None else
                   f"CFG batching does not know {', '.join(unknown)}" if unknown else None)
        handle.cfg_batch_reason = (f"off (cfg_batch=auto): {why_not}" if why_not else
                                   "on (cfg_batch=auto): a step's two guidance calls as one batch of two (NucleusMoE "
                                   "1024², 4 steps, H100 at b3a1445: 0.90x the time eager, 0.935x compiled)")
        log.info("CFG batching %s", handle.cfg_batch_reason)
        if why_not:
            return
    elif guidance is None:
        raise ValueError(f"expected a pipeline CFG batching knows ({', '.join(batching_pipelines())}) with "
                         f"cfg_batch=True, got {type(pipe).__name__}")
    else:
        handle.cfg_batch_reason = "on (cfg_batch=True)"
    for transformer in handle.transformers:
        hook = CFGBatchHook(lambda: guidance(pipe), *text_inputs_of(transformer), output_like=output_like_of(transformer))
        registry = HookRegistry.check_if_exists_or_initialize(transformer)
        registry.register_hook(hook, "xstage-cfg-batch")
        handle.cfg_hooks.append(hook)
        handle._undo.append(lambda registry=registry: registry.remove_hook("xstage-cfg-batch", recurse=False))


def _check_cfg_pairs_before_decode(pipe, handle: ParallelHandle) -> None:
    """Paired CFG: a conditional call left without its partner must fail before the VAE decodes it."""
    from xstage_dit.features.cfg_batch import CFGBatchHook
    from xstage_dit.features.cfg_parallel import PairedCFGHook

    paired = [h for h in handle.cfg_hooks if isinstance(h, (PairedCFGHook, CFGBatchHook))]
    vae = getattr(pipe, "vae", None)
    if not paired or vae is None or not hasattr(vae, "decode"):
        return
    decode = vae.decode

    def checked_decode(*args, **kwargs):
        for hook in paired:
            hook.check_no_pending("the VAE decode")
        return decode(*args, **kwargs)

    handle._undo.append(set_on_instance(vae, "decode", checked_decode))
