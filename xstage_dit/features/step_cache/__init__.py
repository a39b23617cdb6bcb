"""Step caching (the stack's ``step_cache`` feature): diffusers' own cache hooks, one decision for all ranks.

    stack = build_stack(pipe, StackConfig(cache=StepCacheConfig("fbcache", threshold=0.08)))
    with cache_request(pipe, steps=28) as run:      # state reset per request; what it computed and skipped after
        image = pipe(prompt, num_inference_steps=28).images[0]
    run.stats                                        # {"method": "fbcache", "unit": "steps", "computed": 17, ...}

The caches are diffusers 0.42's hooks (``transformer.enable_cache``: First Block Cache, TaylorSeer, MagCache,
Pyramid Attention Broadcast, FasterCache; `config` says which parameters each takes). What this feature adds
is what serving on several ranks needs and diffusers does not do:

- One decision for all ranks (`gate`): First Block Cache's measured change is the whole image's (summed over
  the sequence-parallel shards on the device, in the all-gather the decision needs anyway) and the conditional
  branch decides for both CFG branches, so every rank and branch skips or computes together. The other methods
  decide from step counters, fixed ratios or the timestep, alike on every rank; the CFG hooks run each forward
  under its own branch's cache context, so per-branch state stays per branch under CFG parallel too.
- Per-request state (`handle.StepCacheHandle.request`): reset before each call, never shared by two requests
  (the server runs a caching request alone; a batch of one call shares its decisions).
- Compile: the hooks run outside the graphs (no recompile per step); what they call when they compute is
  compiled (``ctx.compile_inside``). CUDA graphs are refused: a recorded forward cannot skip.
- Counts of computed and skipped steps (or attention calls) per request, for the server's answers and metrics.

Refused, with the reason: pab and fastercache under paired CFG parallel (diffusers keeps one state for a step's
cond and uncond calls, which each rank would then see one of), pab and fastercache on a bare transformer (they
read the pipeline's timestep), compile mode "graphs" (`StackConfig`), a transformer with a diffusers cache
enabled already.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from xstage_dit.features.context import chained, modules_of
from xstage_dit.features.instance_attr import set_on_instance
from xstage_dit.features.step_cache.config import METHODS, THRESHOLD_METHODS, StepCacheConfig
from xstage_dit.features.step_cache.gate import StepGate

__all__ = ["METHODS", "THRESHOLD_METHODS", "SHARED_BRANCH_STATE", "CacheRun", "StepCacheConfig", "StepCacheHandle",
           "StepGate", "apply", "cache_request", "handle_of"]


def __getattr__(name: str) -> Any:
    # The handle imports diffusers' hooks: loaded on first use, so the CLI's option checks (this package's config)
    # stay within the time of --help.
    if name in ("CacheRun", "StepCacheHandle"):
        from xstage_dit.features.step_cache import handle

        return getattr(handle, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# Methods whose diffusers state is one for a step's cond and uncond calls (the uncond call reuses what the cond
# call computed): a rank of paired CFG parallel sees one branch, so its schedule would not be one process's.
SHARED_BRANCH_STATE = ("pab", "fastercache")
_MARK = "_xstage_step_cache"  # on each transformer the feature cached: its handle (`handle_of`)


def apply(pipe: Any, config: StepCacheConfig | None, ctx) -> Callable[[], None] | None:
    """The stack's step cache: a `StepCacheHandle` on every transformer (``ctx.step_cache``), its compute points
    in ``ctx.compile_inside``. ValueError naming what refuses it (module docstring)."""
    if config is None:
        return None
    if not isinstance(config, StepCacheConfig):
        raise ValueError(f"expected a StepCacheConfig, got {type(config).__name__}")
    parallel, groups = ctx.parallel, ctx.groups
    if config.method in SHARED_BRANCH_STATE:
        paired = any(getattr(plan, "cfg", None) == "paired" for plan in ctx.plans)
        if parallel is not None and parallel.cfg > 1 and paired:
            raise ValueError(f"cache {config.method} under CFG parallel (cfg={parallel.cfg}): diffusers keeps one "
                             f"{config.method} state for a step's cond and uncond calls (the uncond call reuses what "
                             "the cond call computed), and each CFG rank sees one of them, so its schedule would not "
                             "be one process's; expected cfg=1 or --cache fbcache, taylorseer or magcache")
        if not ctx.is_pipeline:
            raise ValueError(f"cache {config.method} reads the pipeline's timestep at every attention call: expected "
                             f"a pipeline, got a bare {type(pipe).__name__}")
    world = 1 if groups is None else groups.world_size
    import torch.distributed as dist

    gate = StepGate(world=world, group=dist.group.WORLD if world > 1 else None,
                    threshold=config.threshold if config.method == "fbcache" else 0.0,
                    compute_every=config.compute_every if config.method == "fbcache" else None)
    from xstage_dit.features.step_cache.handle import StepCacheHandle

    handle = StepCacheHandle(pipe, ctx.transformers, config, gate)
    if not handle.points:
        handle.restore()
        raise ValueError(f"cache {config.method}: diffusers found no blocks or attention layers to hook in "
                         f"{', '.join(type(t).__name__ for t in ctx.transformers)}")
    ctx.step_cache = handle
    ctx.compile_inside.extend(handle.compile_inside)
    marks = chained(set_on_instance(t, _MARK, handle) for t in ctx.transformers)

    def undo() -> None:
        marks()
        handle.restore()
        ctx.step_cache = None
        ctx.compile_inside[:] = [p for p in ctx.compile_inside if p not in handle.points]

    return undo


def handle_of(pipe: Any) -> Any:
    """The `StepCacheHandle` the stack applied to `pipe` (a pipeline or a bare transformer), or None."""
    modules = modules_of(pipe)
    return getattr(modules[0], _MARK, None) if modules else None


@contextlib.contextmanager
def cache_request(pipe: Any, steps: int | None = None, threshold: float | None = None) -> Iterator[Any]:
    """One pipeline call as one step-cache request (`StepCacheHandle.request`); where `pipe` has no step cache,
    a `CacheRun` whose stats stay None (a threshold there is a ValueError: nothing would apply it)."""
    handle = handle_of(pipe)
    if handle is None:
        if threshold is not None:
            raise ValueError(f"expected no cache threshold: no step cache runs on this pipeline, got {threshold!r}")
        from xstage_dit.features.step_cache.handle import CacheRun

        yield CacheRun()
        return
    with handle.request(steps, threshold) as run:
        yield run
