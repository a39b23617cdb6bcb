"""`parallelize(pipe, ParallelConfig(...))`: sequence, expert and CFG parallelism for a diffusers pipeline.

    import xstage_dit
    handle = xstage_dit.parallelize(pipe, xstage_dit.ParallelConfig(sp=4))   # under torchrun, 4 ranks
    image = pipe(prompt, generator=torch.Generator().manual_seed(0)).images[0]
    if handle.is_output_rank: image.save("out.png")
    handle.restore()                                                         # the original pipeline again

One module per concern: `config` (ParallelConfig), `groups` (process groups), `sharding` (the split
rule), `sequence_parallel` + `attention_backend` + `processors` + `sdpa_processors` (Ulysses),
`attention_schedules` (the schedule per shape, from the params `calibration.params_for` gives once),
`expert_parallel` (EP MoE layers), `cfg_parallel` (guidance branches), `plans` (model registry, keyed so
subclasses resolve to their family) + `family_plans` (the plans diffusers does not ship),
`collective_safety` (agreement and failures across ranks), `host_syncs` (host copies out of the forward),
`prompt_cache` (CFG's empty negative prompt encoded once), `text_depth` (a text encoder's unread layers not
run), `one_frame_vae` (a video VAE's one-frame decode as a 2-D network), `_diffusers_private` (the only user of
private diffusers API). Each feature is ``apply(pipe, config, ctx) -> undo``; `stack` applies them in its one
declared order (`stack.ORDER`) with one undo stack, `setup` checks and builds what they share (`context`).
`parallelize` is that stack with the parallel features and the pipeline patches it has always made; compile,
batch invariance and the rest come with `xstage_dit.engine.Engine`. Calling `parallelize` on an already
parallelized pipeline is an error (RuntimeError): restore it first.

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
from typing import Any

from xstage_dit.families.registry import moe_layer_classes
from xstage_dit.features.config import ParallelConfig
from xstage_dit.features.setup import check_degrees

log = logging.getLogger(__name__)

__all__ = ["parallelize", "apply_stack", "check_degrees", "ParallelConfig", "ParallelHandle", "supported_models"]


def __getattr__(name: str) -> Any:
    # The handle's class lives with the stack, imported on first use: it pulls in every feature (and the
    # attention op), which the CLI's pre-checks of a ParallelConfig must not pay for.
    if name == "ParallelHandle":
        from xstage_dit.features.stack import FeatureStack

        return FeatureStack
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def supported_models():
    """The transformers `parallelize` supports (see `plans.supported_models_markdown`)."""
    from xstage_dit.features.plans import supported_models as _supported

    return _supported()


def parallelize(pipe: Any, config: ParallelConfig | None = None, **degrees: Any):
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
    Returns the `ParallelHandle` (the feature stack); ``handle.restore()`` gives back the original pipeline.
    """
    if config is None:
        config = ParallelConfig(**degrees)
    elif degrees:
        raise ValueError(f"expected either a ParallelConfig or keyword degrees, got both ({sorted(degrees)})")
    if not isinstance(config, ParallelConfig):
        raise ValueError(f"expected a ParallelConfig, got {type(config).__name__}")
    from xstage_dit.features.stack import StackConfig

    return apply_stack(pipe, StackConfig(parallel=config))


def apply_stack(pipe: Any, config, features=None):
    """`stack.build_stack` of `config` (a `StackConfig`) on `pipe`, with the start-up log lines (what was
    parallelized, one line per layer shape). `features`: the feature table (default `stack.FEATURES`)."""
    from xstage_dit.features.stack import FEATURES, build_stack

    stack = build_stack(pipe, config, FEATURES if features is None else features)
    parallel = config.parallel
    if parallel is None:
        log.info("feature stack on %s: %s", type(pipe).__name__, ", ".join(stack.applied) or "nothing")
        return stack
    for transformer in stack.transformers:
        _log_layer_shapes(transformer, stack)
    groups = stack.groups
    log.info(
        "parallelize %s: world=%d sp=%d ep=%d cfg=%d (rank %d: cfg branch %d, shard %d), %d MoE layers on EP",
        " + ".join(type(t).__name__ for t in stack.transformers), groups.world_size, parallel.sp, parallel.ep,
        parallel.cfg, groups.rank, groups.cfg_rank, groups.sp_rank, stack.num_moe_layers,
    )
    log.info("feature stack: %s", ", ".join(stack.applied))
    return stack


def _log_layer_shapes(transformer, handle) -> None:
    """One startup line per distinct attention / MoE layer shape. The schedule itself depends on the
    token count, known at the first call: each (shape, tokens) decision is logged once, with its reason."""
    attn, moe = {}, {}
    for name, module in transformer.named_modules():
        heads = getattr(module, "heads", None)
        if heads is not None and getattr(module, "processor", None) is not None:
            inner = getattr(module, "inner_dim", None)
            key = (heads, inner // heads if inner else None)
            attn.setdefault(key, []).append(name)
        if hasattr(module, "num_experts_per_rank") or type(module).__name__ in moe_layer_classes():
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
