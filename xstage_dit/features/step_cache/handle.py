"""`StepCacheHandle`: diffusers' cache hooks on a pipeline's transformers, one gate, per-request state and counts.

What it does to each transformer (undone by `restore`):

- ``transformer.enable_cache(config)``: diffusers' own hooks (`config.StepCacheConfig.diffusers_config`).
- Each of those hooks becomes a `CachePoint`: the hook's forward runs outside torch.compile (its Python state,
  step counters and decisions never become Dynamo guards: no recompile per step), counted; what it calls when it
  computes (the block's or attention's own forward) is the point's ``fn``, which the compile feature compiles
  (``ctx.compile_inside``), counted too. Computed and skipped work is read off those counts.
- First Block Cache's decision is the group decision (`gate.StepGate`); TaylorSeer's, under a forced schedule,
  the step index's.
- `StepCacheRootHook` on the transformer (inside the CFG and sequence hooks): names the branch where the pipeline
  sets no diffusers cache context (a call on the same latents as the one before it is that step's second,
  unconditional call), tells pab / fastercache the step's timestep as a host number, and counts steps.

Per request (`request`): every stateful hook's state is reset before the call (a cancelled call, which never
reached diffusers' own reset at its end, leaks nothing into the next), the request's threshold and step count
apply (MagCache's ratios are made for the call's steps), and the counts are read after it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from diffusers.hooks import HookRegistry, ModelHook

from xstage_dit import _diffusers_private as private
from xstage_dit.features.context import COND_CONTEXT, UNCOND_CONTEXT
from xstage_dit.features.instance_attr import remove_hook
from xstage_dit.features.step_cache.config import StepCacheConfig
from xstage_dit.features.step_cache.gate import StepGate
from xstage_dit.features.step_cache.memory import TaylorSeerMemoryCheck

log = logging.getLogger(__name__)

__all__ = ["CachePoint", "CacheRun", "StepCacheHandle", "StepCacheRootHook"]

_ROOT_HOOK = "xstage-step-cache"
# What a method's counts are of: a denoising step computed fully or not (the block stack, or every hooked module
# alike), or single attention calls (pab, fastercache: each attention kind has its own range).
UNITS = {"fbcache": "steps", "magcache": "steps", "taylorseer": "steps", "pab": "attention calls",
         "fastercache": "attention calls"}


class CachePoint:
    """One module a diffusers cache hook wraps. fn: what the hook calls when it computes (the module's own
    forward; the compile feature swaps in a compiled one); runs / computed: the hook's calls and how many computed."""

    def __init__(self, path: str, module: torch.nn.Module, name: str, hook: Any, reference: Any) -> None:
        self.path, self.module, self.name, self.hook, self.reference = path, module, name, hook, reference
        self.fn = reference.original_forward
        self.runs = self.computed = 0
        self.on_compute: Any = None  # called with each output it computes (TaylorSeer's memory check)
        self._hook_forward = reference.forward

    def inner(self, *args: Any, **kwargs: Any) -> Any:
        self.computed += 1
        out = self.fn(*args, **kwargs)
        if self.on_compute is not None:
            self.on_compute(out)
        return out

    @torch.compiler.disable
    def outer(self, *args: Any, **kwargs: Any) -> Any:
        self.runs += 1
        return self._hook_forward(*args, **kwargs)

    def install(self) -> None:
        self.reference.forward, self.reference.original_forward = self.outer, self.inner

    def uninstall(self) -> None:
        self.reference.forward, self.reference.original_forward = self._hook_forward, self.fn


@dataclass
class CacheRun:
    """One pipeline call's step cache: ``stats`` once the call is over ({"method", "unit", "computed",
    "skipped"}), None while it runs or where no step cache is applied."""

    stats: dict | None = None


class StepCacheRootHook(ModelHook):
    """On each transformer, inside the CFG hooks: the branch name where the pipeline sets none, the step's
    timestep for pab / fastercache, the step count (module docstring)."""

    _is_stateful = True  # so diffusers' cache_context() reaches its tracker
    outside_compile = True  # Python state: the compile feature compiles what it calls, not it

    def __init__(self, handle: "StepCacheHandle", witness: CachePoint | None) -> None:
        super().__init__()
        self.handle, self.witness = handle, witness
        self.tracker = private.context_tracker()
        self.last_hidden: Any = None

    def reset_state(self, module):
        self.last_hidden = None
        return module

    def new_forward(self, module, *args, **kwargs):
        forward = self.fn_ref.original_forward
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        name = private.context_name(self.tracker)
        named = name is None
        if named:  # no cache context from the pipeline: its second call of a step reuses the latents tensor
            name = UNCOND_CONTEXT if hidden is not None and hidden is self.last_hidden else COND_CONTEXT
        self.last_hidden = hidden
        if self.handle.memory_check is not None:
            self.handle.memory_check.branch = name
        new_step = self.handle.enter_call(name != UNCOND_CONTEXT)
        before = self.witness.computed if self.witness is not None else 0
        with private.branch_context(module, name, self.tracker) if named else contextlib.nullcontext():
            out = forward(*args, **kwargs)
        if new_step and self.witness is not None:
            self.handle.count_step(self.witness.computed > before)
        return out


def _disable(transformer: torch.nn.Module, hooks: list[tuple[torch.nn.Module, str]]) -> None:
    """diffusers' ``disable_cache``, leaving no empty registry or bound ``forward`` on the modules it hooked."""
    for module, name in reversed(hooks):
        remove_hook(module, name)
    private.forget_cache_config(transformer)


@dataclass
class _Applied:
    transformer: torch.nn.Module
    points: list[CachePoint] = field(default_factory=list)
    undos: list = field(default_factory=list)


class StepCacheHandle:
    """The step cache of one pipeline (module docstring). config: its `StepCacheConfig`; gate: the `StepGate`;
    pipe: the pipeline (its scheduler's timesteps, for pab / fastercache); points: every `CachePoint`."""

    def __init__(self, pipe: Any, transformers: list, config: StepCacheConfig, gate: StepGate) -> None:
        self.pipe, self.config, self.gate = pipe, config, gate
        self.unit = UNITS[config.method]
        self.applied: list[_Applied] = []
        # MagCache's ratios need a step count before a request names one (`request`): diffusers' default
        self._steps_default = 28
        self._timesteps: list[float] = []
        self._timesteps_of: Any = None
        self._step, self._after_lead = -1, False
        self._counts = {"computed": 0, "skipped": 0}
        self._run: CacheRun | None = None
        try:
            for transformer in transformers:
                self.applied.append(self._apply(transformer))
        except BaseException:
            self.restore()
            raise
        self.memory_check = self._memory_check(self.points)

    # ----- apply / restore -----
    def _apply(self, transformer: torch.nn.Module) -> _Applied:
        applied = _Applied(transformer)
        private.check_no_cache(transformer)
        blocks = private.cache_blocks(transformer)
        if self.config.method == "fbcache" and len(blocks) < 2:
            raise ValueError(f"cache fbcache needs at least 2 transformer blocks (the first decides, the others are "
                             f"skipped), got {len(blocks)} in {type(transformer).__name__}")
        if not callable(getattr(transformer, "enable_cache", None)):
            raise ValueError(f"expected a diffusers model with enable_cache (CacheMixin), got {type(transformer).__name__}")
        had_registry = private.modules_with_hooks(transformer)
        try:
            attentions = tuple(f"{name}.{path}" for name, block in blocks for path, module in block.named_modules()
                               if path and getattr(module, "processor", None) is not None)
            transformer.enable_cache(self.config.diffusers_config(self._steps_default, self.timestep, attentions))
        except ValueError as exc:
            _disable(transformer, [(m, n) for _, m, n, _, _ in private.cache_hook_points(transformer)])
            private.drop_empty_registries(transformer, keep=had_registry)  # made for hooks never registered
            if "not registered" not in str(exc):
                raise
            raise ValueError(f"cache {self.config.method}: diffusers' block registry does not know the blocks of "
                             f"{type(transformer).__name__} ({exc}); expected --cache taylorseer or pab there") from exc
        found = private.cache_hook_points(transformer)
        applied.undos.append(functools.partial(_disable, transformer, [(module, name) for _, module, name, _, _ in found]))
        for path, module, name, hook, reference in found:
            point = CachePoint(path, module, name, hook, reference)
            point.install()
            applied.undos.append(point.uninstall)
            applied.points.append(point)
        for point in applied.points:
            undo = self._decision(point)
            if undo is not None:
                applied.undos.append(undo)
        registry = HookRegistry.check_if_exists_or_initialize(transformer)
        registry.register_hook(StepCacheRootHook(self, self._witness(applied.points)), _ROOT_HOOK)
        applied.undos.append(functools.partial(remove_hook, transformer, _ROOT_HOOK))
        return applied

    def _decision(self, point: CachePoint):
        """Put the group decision (fbcache) or the forced schedule (taylorseer) into the point's hook; the undo."""
        if private.is_fbc_head(point.name):
            return private.replace_fbc_decision(point.hook, self.gate.decide)
        if private.is_taylorseer(point.name) and self.config.compute_every is not None:
            return private.force_taylorseer_schedule(point.hook, self.config.compute_every)
        return None

    def _memory_check(self, points: list[CachePoint]) -> TaylorSeerMemoryCheck | None:
        """TaylorSeer (not lite): its state checked against the free memory at each branch's first output
        (`memory.TaylorSeerMemoryCheck`), on every cached point; None for the other methods."""
        if self.config.method != "taylorseer" or self.config.lite:
            return None
        cached = [p for p in points if private.is_taylorseer(p.name)]
        check = TaylorSeerMemoryCheck(len(cached), self.config.max_order + 1)
        for point in cached:
            point.on_compute = check
        return check

    def _witness(self, points: list[CachePoint]) -> CachePoint | None:
        """The point whose compute tells a step computed from a skipped one: the block stack's last block
        (fbcache, magcache), the first hooked module (taylorseer); None where units are attention calls."""
        if self.unit != "steps" or not points:
            return None
        blocks = [p for p in points if not private.is_fbc_head(p.name) and not private.is_mag_head(p.name)]
        return (blocks or points)[-1] if self.config.method != "taylorseer" else points[0]

    def restore(self) -> None:
        """Every hook, decision and swap undone, in reverse (idempotent)."""
        while self.applied:
            applied = self.applied.pop()
            while applied.undos:
                applied.undos.pop()()

    @property
    def points(self) -> list[CachePoint]:
        return [p for applied in self.applied for p in applied.points]

    @property
    def compile_inside(self) -> list[CachePoint]:
        """The points whose ``fn`` the compile feature compiles (the modules below a transformer)."""
        return [p for applied in self.applied for p in applied.points if p.module is not applied.transformer]

    # ----- per call -----
    def timestep(self) -> float:
        """The current step's timestep as a host number (pab / fastercache compare it with their ranges at every
        attention call: ``pipe.current_timestep`` is a device tensor, one host sync each). The scheduler's
        timesteps are copied to the host once per call (``set_timesteps`` makes a new tensor), its ``step_index``
        (None before a call's first step) says which; a scheduler without one: this call's step count."""
        scheduler = getattr(self.pipe, "scheduler", None)
        timesteps = getattr(scheduler, "timesteps", None)
        if timesteps is None:
            raise RuntimeError(f"step cache {self.config.method}: expected the pipeline's scheduler to hold its "
                               f"timesteps, got {type(scheduler).__name__}")
        if timesteps is not self._timesteps_of:
            self._timesteps_of = timesteps
            self._timesteps = [float(t) for t in torch.as_tensor(timesteps).detach().cpu().tolist()]
        index = scheduler.step_index if hasattr(scheduler, "step_index") else self._step
        if index is None:
            index = getattr(scheduler, "begin_index", None) or 0
        return self._timesteps[min(max(int(index), 0), len(self._timesteps) - 1)]

    def enter_call(self, lead: bool) -> bool:
        """A transformer call begins; True where it starts a step on this rank: a lead (cond) call, or an uncond
        call that no cond call of this rank preceded (CFG parallel's uncond ranks)."""
        new_step = lead or not self._after_lead
        self._after_lead = lead
        if new_step:
            self._step += 1
        return new_step

    def count_step(self, computed: bool) -> None:
        self._counts["computed" if computed else "skipped"] += 1

    def stats(self) -> dict:
        """The counts since the request began: {"method", "unit", "computed", "skipped"}."""
        if self.unit == "steps":
            computed, skipped = self._counts["computed"], self._counts["skipped"]
        else:  # the attention hooks' calls (not a denoiser-level hook's, which wraps the whole forward)
            points = self.compile_inside
            computed = sum(p.computed for p in points)
            skipped = sum(p.runs - p.computed for p in points)
        return {"method": self.config.method, "unit": self.unit, "computed": computed, "skipped": skipped}

    def _reset(self) -> None:
        for applied in self.applied:
            HookRegistry.check_if_exists_or_initialize(applied.transformer).reset_stateful_hooks()
        for point in self.points:
            point.runs = point.computed = 0
        self._counts = {"computed": 0, "skipped": 0}
        self._step, self._after_lead = -1, False
        if self.memory_check is not None:
            self.memory_check.reset()

    @contextlib.contextmanager
    def request(self, steps: int | None = None, threshold: float | None = None) -> Iterator[CacheRun]:
        """One pipeline call of `steps` denoising steps (None: as configured) with the request's `threshold`
        (None: the configured one; ValueError where the method takes none): state reset before and after, the
        counts in the yielded `CacheRun` once the call is over."""
        config = self.config.with_threshold(threshold)
        if self._run is not None:
            raise RuntimeError("expected one step-cache request at a time, got a second one inside the first")
        self._reset()
        self.gate.begin(config.threshold if config.method == "fbcache" else None)
        if config.method == "magcache":
            private.set_mag_cache_config([p.hook for p in self.points], config.mag_cache_config(
                steps or self._steps_default))
        run = self._run = CacheRun()
        try:
            yield run
            run.stats = self.stats()
        finally:
            self._run = None
            self._reset()  # the cached tensors go with the request
            self.gate.begin(self.config.threshold if self.config.method == "fbcache" else None)

    def describe(self) -> dict:
        return {**self.config.describe(), "unit": self.unit, "hooked_modules": len(self.points),
                "decision": ("group (sums all-gathered over the ranks, cond leads)" if self.config.method == "fbcache"
                             else "diffusers' own (step counters or fixed ratios: alike on every rank)")}
