"""Sequence parallelism (Ulysses degree sp) for a diffusers transformer, reversibly.

A plan in diffusers' ``_cp_plan`` vocabulary says where the token sequence is split on entry and
gathered on exit (each family record's plan: ours, or diffusers' own; `plans.plan_for` finds it). The split/gather hooks here use
diffusers' public hook registry (``diffusers.hooks.HookRegistry`` / ``ModelHook``) and the one split
rule of `sharding.split_sizes`; every attention processor is pointed at the ``xstage_ulysses`` backend
with an `AttentionContext` (or swapped for an xstage processor where the model calls SDPA directly: the plan
names it as a factory or as its ``"module:attribute"``, resolved here).
`apply_sequence_parallel` returns an `undo` callable that puts everything back.
"""

from __future__ import annotations

import copy
import fnmatch
import importlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from diffusers.hooks import HookRegistry, ModelHook

from xstage_dit.comm.group_names import group_name
from xstage_dit import _diffusers_private as private
from xstage_dit.families import sharding
from xstage_dit.families.sp_plan import SequenceParallelSpec, SequenceState
from xstage_dit.features.attention_backend import AttentionContext, xstage_attention
from xstage_dit.features.attention_schedules import AttentionSchedules
from xstage_dit.features.collective_safety import check_dispatching
from xstage_dit.features.context import chained
from xstage_dit.features.instance_attr import remove_hook
from xstage_dit.features.qk_bounds import qk_norms

log = logging.getLogger(__name__)

_HOOK_PREFIX = "xstage-sp"


class _ForwardArgs:
    """Finds a named forward parameter among args/kwargs (signature of the module's class)."""

    def __init__(self, module: torch.nn.Module) -> None:
        forward = type(module).forward
        self.names = list(inspect.signature(forward).parameters)[1:]

    def get(self, name: str, args: list, kwargs: dict) -> tuple[Any, str | int | None]:
        if name in kwargs:
            return kwargs[name], name
        if name in self.names:
            index = self.names.index(name)
            if index < len(args):
                return args[index], index
        return None, None


class _PlanHook(ModelHook):
    """A family plan's `PlanHook` registered as a diffusers hook (families/ does not import diffusers' hooks)."""

    def __init__(self, hook) -> None:
        super().__init__()
        self.hook = hook

    def pre_forward(self, module, *args, **kwargs):
        return self.hook.pre_forward(module, *args, **kwargs)

    def post_forward(self, module, output):
        return self.hook.post_forward(module, output)


def _resolve(swap: Callable[[Any], Any] | str) -> Callable[[Any], Any]:
    """A processor swap of a plan: a factory, or its ``"module:attribute.path"`` (how a family file names a
    processor that lives in features/)."""
    if not isinstance(swap, str):
        return swap
    module_name, _, path = swap.partition(":")
    if not module_name or not path:
        raise ValueError(f"expected a processor swap as 'module:attribute', got {swap!r}")
    target: Any = importlib.import_module(module_name)
    for part in path.split("."):
        target = getattr(target, part)
    return target


class RootHook(ModelHook):
    """Outermost hook on the transformer: starts a fresh per-forward state."""

    def __init__(self, state: SequenceState) -> None:
        super().__init__()
        self.state = state

    def pre_forward(self, module, *args, **kwargs):
        self.state.totals.clear()
        self.state.named.clear()
        return args, kwargs


class SplitHook(ModelHook):
    """Splits named inputs (or indexed outputs, ``split_output=True``) along the sequence dim."""

    def __init__(self, metadata: dict, state: SequenceState) -> None:
        super().__init__()
        self.metadata = metadata
        self.state = state
        self.args = None
        self.where = "an input"

    def initialize_hook(self, module):
        self.args = _ForwardArgs(module)
        self.where = f"the input of {type(module).__name__}"
        return module

    def _split(self, x: torch.Tensor, cpi) -> torch.Tensor:
        if cpi.expected_dims is not None and x.dim() != cpi.expected_dims:
            return x  # same rule as diffusers: a tensor of another rank is not the sequence
        # an empty shard would fail in model code on that rank alone: refuse on every rank alike
        sharding.check_splittable(x.shape[cpi.split_dim], self.state.world, f"{self.where} (dim {cpi.split_dim})")
        self.state.record(x.shape[cpi.split_dim])
        return sharding.shard(x, cpi.split_dim, self.state.rank, self.state.world)

    def _split_value(self, value, cpi):
        if isinstance(value, torch.Tensor):
            return self._split(value, cpi)
        if isinstance(value, (list, tuple)):
            if len(value) != len(cpi):
                raise ValueError(f"expected {len(cpi)} tensors to split, got {len(value)}")
            return type(value)(self._split(v, c) if torch.is_tensor(v) and not c.split_output else v for v, c in zip(value, cpi))
        raise ValueError(f"expected a tensor or a list of tensors to split, got {type(value).__name__}")

    def pre_forward(self, module, *args, **kwargs):
        args = list(args)
        for name, cpi in self.metadata.items():
            if isinstance(name, int) or getattr(cpi, "split_output", False):
                continue
            value, where = self.args.get(name, args, kwargs)
            if value is None:
                continue
            value = self._split_value(value, cpi)
            if isinstance(where, str):
                kwargs[where] = value
            else:
                args[where] = value
        return tuple(args), kwargs

    def post_forward(self, module, output):
        indexed = {k: v for k, v in self.metadata.items() if isinstance(k, int)}
        if not indexed:
            return output
        single = isinstance(output, torch.Tensor)
        items = [output] if single else list(output)
        for index, cpi in indexed.items():
            items[index] = self._split(items[index], cpi)
        return items[0] if single else type(output)(items)


class GatherHook(ModelHook):
    """Gathers outputs along the sequence dim on exit (inverse of the split)."""

    def __init__(self, outputs: list, state: SequenceState) -> None:
        super().__init__()
        self.outputs = outputs
        self.state = state

    def post_forward(self, module, output):
        single = isinstance(output, torch.Tensor)
        items = [output] if single else list(output)
        if len(items) != len(self.outputs):
            raise ValueError(f"expected {len(self.outputs)} outputs to gather, got {len(items)}")
        for i, cpo in enumerate(self.outputs):
            if cpo is None:
                continue
            x = items[i]
            if cpo.expected_dims is not None and x.dim() != cpo.expected_dims:
                continue
            total = self.state.total_for(x.shape[cpo.gather_dim])
            items[i] = sharding.gather(x, cpo.gather_dim, self.state.group, total)
        return items[0] if single else type(output)(items)


def _submodules(model: torch.nn.Module, pattern: str) -> list[tuple[str, torch.nn.Module]]:
    """Modules matching a plan key: "" (the model), a dotted name, or a name with one "*" wildcard."""
    if pattern == "":
        return [("", model)]
    if "*" not in pattern:
        try:
            return [(pattern, model.get_submodule(pattern))]
        except AttributeError as exc:
            raise ValueError(f"plan names module {pattern!r}, which {type(model).__name__} does not have") from exc
    found = [(n, m) for n, m in model.named_modules() if n and fnmatch.fnmatchcase(n, pattern) and n.count(".") == pattern.count(".")]
    if not found:
        raise ValueError(f"plan names modules {pattern!r}, none of which {type(model).__name__} has")
    return found


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every attention module with a processor."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "processor") and m.processor is not None]


def check_heads(model: torch.nn.Module, sp: int) -> None:
    """Raise ValueError naming the module if an attention has fewer heads than sp ranks.

    The Ulysses op splits heads unevenly when they do not divide (the first ``heads % sp`` ranks take
    one more), so the only head count sp cannot split is one below sp.
    """
    for name, module in attention_modules(model):
        heads = getattr(module, "heads", None)
        if heads is not None and heads < sp:
            raise ValueError(
                f"expected at least sp={sp} heads in every attention (Ulysses gives each rank >= 1 head), got "
                f"heads={heads} in {type(model).__name__}.{name}"
            )


def _layout_for(name: str, kv_layouts: dict[str, str]) -> str:
    for pattern, layout in kv_layouts.items():
        if fnmatch.fnmatchcase(name, pattern):
            return layout
    return "sharded"


def _set_processor(module, processor) -> None:
    if hasattr(module, "set_processor"):
        module.set_processor(processor)
    else:  # pragma: no cover - every diffusers attention has set_processor
        module.processor = processor


def apply_sequence_parallel(
    model: torch.nn.Module,
    spec: SequenceParallelSpec,
    *,
    group,
    rank: int,
    world: int,
    schedules: AttentionSchedules,
) -> Callable[[], None]:
    """Install split/gather hooks and the xstage attention on `model`; return `undo`.

    schedules: the attention schedule per shape, shared by every attention module (decided once per shape).
    At world 1 only the attention is routed (through the op's world-1 path); no hooks.
    """
    _, cp_output_cls = private.cp_types()
    backend, release_backend = private.register_attention_backend(xstage_attention)
    if group is not None:
        # The op names groups by string across the custom-op boundary; register ours now, eagerly, so a
        # torch.compile'd model (which traces, not runs, the registration) can resolve the name.
        group_name(group)
    state = SequenceState(rank=rank, world=world, group=group)
    hooked: list[tuple[torch.nn.Module, str]] = []
    processors: list[tuple[torch.nn.Module, Any]] = []
    try:
        if world > 1:
            for i, (key, entry) in enumerate(spec.cp_plan.items()):
                for _, module in _submodules(model, key):
                    if isinstance(entry, dict):
                        hook = SplitHook(entry, state)
                    else:
                        outputs = [entry] if isinstance(entry, cp_output_cls) else list(entry)
                        hook = GatherHook(outputs, state)
                    hook_name = f"{_HOOK_PREFIX}-{i}-{key}"
                    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, hook_name)
                    hooked.append((module, hook_name))
            for key, factory in spec.extra_hooks:
                for _, module in _submodules(model, key):
                    hook_name = f"{_HOOK_PREFIX}-extra-{key}"
                    hook = factory(state)
                    hook = hook if isinstance(hook, ModelHook) else _PlanHook(hook)
                    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, hook_name)
                    hooked.append((module, hook_name))
            root = f"{_HOOK_PREFIX}-root"
            HookRegistry.check_if_exists_or_initialize(model).register_hook(RootHook(state), root)
            hooked.append((model, root))

        for name, module in attention_modules(model):
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in spec.local_attention):
                continue
            original = module.processor
            ctx = AttentionContext(
                group=group, rank=rank, world=world, schedules=schedules, kv_layout=_layout_for(name, spec.kv_layouts),
                name=name, state=state, qk_norms=qk_norms(module, original),
            )
            swap = spec.processor_swaps.get(type(original).__name__)
            if swap is not None and type(original).__module__.startswith("diffusers."):
                patched = _resolve(swap)(original)
            elif hasattr(original, "_attention_backend"):
                # a user's subclass may override __call__ and call SDPA itself: refused, named
                check_dispatching(original, f"{type(model).__name__}.{name}")
                patched = copy.copy(original)  # processors may be shared between modules
            else:
                raise ValueError(
                    f"expected attention processors that call diffusers' dispatch_attention_fn, got "
                    f"{type(original).__name__} in {type(model).__name__}.{name} (no xstage replacement for it)"
                )
            patched._attention_backend = backend
            patched._parallel_config = ctx
            _set_processor(module, patched)
            processors.append((module, original))
        schedules.kernels.note_qk_bounds(all(p._parallel_config.qk_norms is not None
                                             for p in (m.processor for m, _ in processors)))
    except BaseException:
        _undo(model, hooked, processors)
        release_backend()
        raise

    def undo() -> None:
        _undo(model, hooked, processors)
        release_backend()  # the enum member goes with the last user

    return undo


def _undo(model, hooked, processors) -> None:
    for module, hook_name in reversed(hooked):
        remove_hook(module, hook_name)
    for module, original in processors:
        _set_processor(module, original)
    hooked.clear()
    processors.clear()


def apply(pipe, config, ctx) -> Callable[[], None] | None:
    """The stack's sequence parallelism: each transformer's plan (`ModelPlan.build_sp`) installed over the sp
    group, its attention routed to the schedules the attention-kernel choice left in ``ctx.schedules``."""
    groups = ctx.groups
    return chained(apply_sequence_parallel(transformer, plan.build_sp(transformer), group=groups.sp_group,
                                           rank=groups.sp_rank, world=config.sp, schedules=ctx.schedules)
                   for transformer, plan in zip(ctx.transformers, ctx.plans))
