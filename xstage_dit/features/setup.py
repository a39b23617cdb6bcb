"""What the stack does before its parallel features: the ranks agree, the model's rules are checked, the groups
are built and the X-Stage params resolved (`prepare`), all before any GPU work.

Never a hang (issue 18): before any other collective the ranks compare their configuration, model classes and
weight shapes (`RanksDisagree` on every rank if they differ); a validation error on one rank is raised on all
(`RankFailed`, also of the original builtin kind: ``except ValueError`` works).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from xstage_dit.calibration.provider import ChosenParams, params_for
from xstage_dit.features.config import ParallelConfig
from xstage_dit.features.context import MARK, FeatureContext, modules_of, transformers_of
from xstage_dit.features.groups import ParallelGroups, build_groups

log = logging.getLogger(__name__)


def _ensure_process_group(config: ParallelConfig) -> None:
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from xstage_dit.comm.distributed import init_distributed

        init_distributed(timeout_s=config.timeout_s)


def calibrated_params(config: ParallelConfig, groups: ParallelGroups) -> ChosenParams | None:
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
    if config.cfg_batch is True:  # "auto" turns itself off where it does not apply (`cfg_batch.apply`)
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


def prepare(pipe: Any, config: ParallelConfig, ctx: FeatureContext, facts: dict | None = None) -> None:
    """Agree across ranks (on `facts` too: the other features' configs, e.g. the LoRA feature's), validate, build
    the groups and resolve the params; fills ``ctx.transformers``,
    ``plans``, ``groups`` and ``calibration``. Errors (before any GPU work): ValueError for degrees that do not
    multiply to the world size or that the model refuses, an unsupported transformer; RuntimeError if a
    transformer is patched already. At world > 1 every rank raises the same error (`RanksDisagree`,
    `RankFailed`)."""
    from xstage_dit import _diffusers_private as private
    from xstage_dit.comm.agreement import check_agreement, fail_together
    from xstage_dit.features.collective_safety import setup_facts
    from xstage_dit.features.plans import plan_for

    _ensure_process_group(config)
    world = dist.get_world_size() if dist.is_initialized() else 1
    # Before any collective that depends on them, every rank checks the others passed the same
    # configuration, model classes and weight shapes (one all-gather), then validates locally; an error
    # on one rank becomes the same error on all (one more all-gather), so none is left in new_group().
    check_agreement({**setup_facts(config, modules_of(pipe)), **(facts or {})}, what="parallelize")
    with fail_together(what="parallelize"):
        private.check_diffusers_version()
        transformers = transformers_of(pipe)
        plans = []
        for transformer in transformers:
            if getattr(transformer, MARK, None) is not None:
                raise RuntimeError(
                    "expected a pipeline that is not parallelized yet, got one already patched: call restore() first"
                )
            if plan_for(transformer).moe_layers:
                from xstage_dit.features.expert_parallel import check_loaded_shards

                check_loaded_shards(transformer, config.ep)  # loaded with expert_shard=(r, w): ep must be w
            plans.append(check_degrees(transformer, config))
        config.check_world(world)
    ctx.transformers, ctx.plans = transformers, plans
    ctx.groups = build_groups(config)
    ctx.calibration = calibrated_params(config, ctx.groups)
