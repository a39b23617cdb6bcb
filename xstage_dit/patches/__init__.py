"""`parallelize(pipe, ParallelConfig(...))`: sequence, expert and CFG parallelism for a diffusers pipeline.

    import xstage_dit
    handle = xstage_dit.parallelize(pipe, xstage_dit.ParallelConfig(sp=4))   # under torchrun, 4 ranks
    image = pipe(prompt, generator=torch.Generator().manual_seed(0)).images[0]
    if handle.is_output_rank: image.save("out.png")
    handle.restore()                                                         # the original pipeline again

One module per concern: `config` (ParallelConfig), `groups` (process groups), `sharding` (the split
rule), `sequence_parallel` + `attention_backend` + `processors` (Ulysses), `expert_parallel` (EP MoE
layers), `cfg_parallel` (guidance branches), `plans` (model registry), `_diffusers_private` (the only
user of private diffusers API). Calling `parallelize` on an already parallelized pipeline is an error
(RuntimeError): restore it first.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from xstage_dit.patches.config import ParallelConfig
from xstage_dit.patches.groups import ParallelGroups

log = logging.getLogger(__name__)

__all__ = ["parallelize", "ParallelConfig", "ParallelHandle", "supported_models"]

_MARK = "_xstage_parallel_handle"


@dataclass
class ParallelHandle:
    """What `parallelize` did, and how to undo it.

    config / groups: the configuration and this rank's groups. is_output_rank: True on global rank 0
    (the only rank that should write files). schedule_choices: attention schedule per distinct shape
    (filled as shapes are first seen). restore(): puts the pipeline back exactly (idempotent).
    """

    config: ParallelConfig
    groups: ParallelGroups
    transformer: torch.nn.Module  # pipe.transformer
    transformers: list = field(default_factory=list)  # every patched one (Wan 2.2 A14B: + transformer_2)
    calibration: Any = None
    schedule_choices: dict = field(default_factory=dict)
    num_moe_layers: int = 0
    cfg_hooks: list = field(default_factory=list)  # the CFG hooks (.stats count parallel pairs / split calls)
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def cfg_hook(self) -> Any:
        """The CFG hook of pipe.transformer (None when cfg=1)."""
        return self.cfg_hooks[0] if self.cfg_hooks else None

    @property
    def is_output_rank(self) -> bool:
        return self.groups.rank == 0

    @property
    def active(self) -> bool:
        return getattr(self.transformer, _MARK, None) is self

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
    from xstage_dit.patches.plans import supported_models as _supported

    return _supported()


def _transformers_of(pipe: Any) -> list[torch.nn.Module]:
    """pipe.transformer, and pipe.transformer_2 where the pipeline has a second expert (Wan 2.2 A14B)."""
    transformer = getattr(pipe, "transformer", None)
    if transformer is None and isinstance(pipe, torch.nn.Module):
        return [pipe]  # a bare transformer
    if transformer is None:
        raise ValueError(f"expected a diffusers pipeline with a .transformer (a DiT pipeline), got {type(pipe).__name__}")
    second = getattr(pipe, "transformer_2", None)
    return [transformer] + ([second] if isinstance(second, torch.nn.Module) else [])


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


def _startup_calibration(config: ParallelConfig, groups: ParallelGroups):
    """X-Stage params for the schedule choice: loaded or measured once per machine (rank 0 first)."""
    if config.schedule != "auto":
        log.info("attention schedule fixed by the user: %s (no calibration needed)", config.schedule)
        return None, None
    if not config.calibrate or groups.device.type != "cuda":
        why = "calibrate=False" if not config.calibrate else f"no GPU ({groups.device.type})"
        log.info("no X-Stage calibration (%s): schedules use the uncalibrated rule", why)
        return None, None
    try:
        from xstage_dit.calibration.runner import CalibrationUnavailable, load_or_calibrate
    except ImportError as exc:
        log.warning("no X-Stage calibration module (%s): schedules use the uncalibrated rule", exc)
        return None, None

    def load():
        try:
            return load_or_calibrate(groups.device, quick=True)
        except CalibrationUnavailable as exc:
            log.info("no X-Stage calibration (%s): schedules use the uncalibrated rule", exc)
            return None

    # One measurement per machine: rank 0 measures (or loads the cache), the others then load it.
    result = load() if groups.rank == 0 else None
    if groups.world_size > 1:
        dist.barrier()
    if groups.rank != 0:
        result = load()
    if result is None:
        return None, None
    params = result.params
    own_gpus = torch.cuda.device_count() >= groups.world_size and groups.world_size > 1
    for target in (("nvlink",) if own_gpus else ()) + ("local", "host", "nvlink"):
        if target in params:
            xp = params[target]
            log.info(
                "X-Stage calibration (%s, %s, target %s): R=%.3g B/s, T_iss0=%.3g s at K=%d, Q=%.3g B",
                result.source, getattr(result, "machine_key", "?"), target, xp.drain_rate_Bps, xp.t_iss0_fixed_s,
                xp.num_producers, xp.capacity_bytes,
            )
            return result, xp
    return result, None


def parallelize(pipe: Any, config: ParallelConfig | None = None, **degrees: Any) -> ParallelHandle:
    """Make `pipe` (a diffusers DiT pipeline, or a bare transformer) run on `sp * cfg` ranks.

    config: a ParallelConfig, or its fields as keyword arguments (``parallelize(pipe, sp=4)``).
    Call on every rank after loading the same weights (torchrun, or ``xstage-dit generate --sp N``).
    Errors, raised before any GPU work: ValueError for degrees that do not multiply to the world
    size, a head count sp cannot split, ep > 1 on a model without MoE layers, cfg=2 where CFG does
    not apply, or an unsupported transformer; RuntimeError if `pipe` is already parallelized.
    Returns a `ParallelHandle`; ``handle.restore()`` gives back the original pipeline.
    """
    if config is None:
        config = ParallelConfig(**degrees)
    elif degrees:
        raise ValueError(f"expected either a ParallelConfig or keyword degrees, got both ({sorted(degrees)})")
    if not isinstance(config, ParallelConfig):
        raise ValueError(f"expected a ParallelConfig, got {type(config).__name__}")

    from xstage_dit.comm.agreement import check_agreement, fail_together
    from xstage_dit.patches import _diffusers_private as private
    from xstage_dit.patches.collective_safety import setup_facts
    from xstage_dit.patches.plans import plan_for
    from xstage_dit.patches.sequence_parallel import check_heads

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
            plan = plan_for(transformer)
            if plan.moe_layers:
                from xstage_dit.patches.expert_parallel import check_loaded_shards

                check_loaded_shards(transformer, config.ep)  # loaded with expert_shard=(r, w): ep must be w
            if plan.check is not None:
                plan.check(transformer, config)
            if config.ep > 1 and not plan.moe_layers:
                raise ValueError(f"expected ep=1 for {type(transformer).__name__} (no MoE layers to shard), got ep={config.ep}")
            if config.cfg > 1 and plan.cfg is None:
                raise ValueError(f"expected cfg=1: CFG parallel does not apply to {type(transformer).__name__}, got cfg={config.cfg}")
            check_heads(transformer, config.sp)
            plans.append(plan)
        config.check_world(world)

    from xstage_dit.patches.groups import build_groups

    groups = build_groups(config)
    calibration, xparams = _startup_calibration(config, groups)
    handle = ParallelHandle(config=config, groups=groups, transformer=transformers[0], transformers=transformers,
                            calibration=calibration)
    try:
        for transformer, plan in zip(transformers, plans):
            _apply(transformer, plan, handle, xparams)
        _check_cfg_pairs_before_decode(pipe, handle)
    except BaseException:
        handle.restore()
        raise
    for transformer in transformers:
        setattr(transformer, _MARK, handle)
        _log_layer_shapes(transformer, handle, xparams)
    log.info(
        "parallelize %s: world=%d sp=%d ep=%d cfg=%d (rank %d: cfg branch %d, shard %d), %d MoE layers on EP",
        " + ".join(type(t).__name__ for t in transformers), world, config.sp, config.ep, config.cfg, groups.rank,
        groups.cfg_rank, groups.sp_rank, handle.num_moe_layers,
    )
    return handle


def _log_layer_shapes(transformer, handle: ParallelHandle, xparams) -> None:
    """One startup line per distinct attention / MoE layer shape. The schedule itself depends on the
    token count, known at the first call: each (shape, tokens) decision is logged once, with its reason."""
    attn, moe = {}, {}
    for name, module in transformer.named_modules():
        heads = getattr(module, "heads", None)
        if heads is not None and getattr(module, "processor", None) is not None:
            inner = getattr(module, "inner_dim", None)
            key = (heads, inner // heads if inner else None)
            attn.setdefault(key, []).append(name)
        if hasattr(module, "num_experts_per_rank") or type(module).__name__ in ("NucleusMoELayer", "MOEFeedForwardSwiGLU"):
            key = (type(module).__name__, getattr(module, "hidden_size", None), getattr(module, "num_experts", None))
            moe.setdefault(key, []).append(name)
    calibrated = "calibrated" if xparams is not None else "uncalibrated (no X-Stage params)"
    for (heads, head_dim), names in attn.items():
        log.info("attention shape heads=%s head_dim=%s (%d layers, sp=%d): schedule %s, %s design test at the first "
                 "call per token count", heads, head_dim, len(names), handle.config.sp, handle.config.schedule, calibrated)
    for (cls, hidden, experts), names in moe.items():
        log.info("MoE shape %s hidden=%s experts=%s (%d layers, ep=%d): combine order chosen by the EP layer per token "
                 "count (%s)", cls, hidden, experts, len(names), handle.config.ep, calibrated)


def _apply(transformer, plan, handle: ParallelHandle, xparams) -> None:
    from diffusers.hooks import HookRegistry

    from xstage_dit.patches.cfg_parallel import BatchedCFGHook, PairedCFGHook
    from xstage_dit.patches.compile_fixes import fix_grouped_mm_offsets
    from xstage_dit.patches.expert_parallel import apply_expert_parallel
    from xstage_dit.patches.sequence_parallel import apply_sequence_parallel

    config, groups = handle.config, handle.groups
    if config.ep > 1:
        undo_ep, num_moe = apply_expert_parallel(transformer, plan.moe_layers, groups.sp_group)
        handle.num_moe_layers += num_moe
        handle._undo.append(undo_ep)
    # MoE layers that stay diffusers' own (ep = 1) get the torch.compile work-around of compile_fixes.
    handle._undo.append(fix_grouped_mm_offsets(transformer)[0])

    spec = plan.build_sp(transformer)
    handle._undo.append(
        apply_sequence_parallel(
            transformer, spec, group=groups.sp_group, rank=groups.sp_rank, world=config.sp,
            schedule=config.schedule, xparams=xparams, choices=handle.schedule_choices,
        )
    )

    if groups.sp_group is not None and config.sp > 1:
        # outside the sequence hooks (sees the whole inputs), inside the CFG hook (one branch's inputs)
        from xstage_dit.patches.collective_safety import CollectiveSafetyHook

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


def _check_cfg_pairs_before_decode(pipe, handle: ParallelHandle) -> None:
    """Paired CFG: a conditional call left without its partner must fail before the VAE decodes it."""
    from xstage_dit.patches.cfg_parallel import PairedCFGHook

    paired = [h for h in handle.cfg_hooks if isinstance(h, PairedCFGHook)]
    vae = getattr(pipe, "vae", None)
    if not paired or vae is None or not hasattr(vae, "decode"):
        return
    decode = vae.decode

    def checked_decode(*args, **kwargs):
        for hook in paired:
            hook.check_no_pending("the VAE decode")
        return decode(*args, **kwargs)

    vae.decode = checked_decode
    handle._undo.append(lambda: vae.__dict__.pop("decode", None))
