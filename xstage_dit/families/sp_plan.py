"""The vocabulary of a family's sequence-parallel plan: `SequenceParallelSpec` (what a family record's plan
builds for `features.sequence_parallel.apply_sequence_parallel`) and `SequenceState` (the per-forward facts the
plan's hooks share), and the helpers the family files build their plans with (`shipped_plan`, `rope_split`,
`blocks_of`). Processor swaps and EP layers are named as ``"module:attribute"`` strings, resolved by the
feature that applies them, so a family file never imports a feature. A plan's own hooks are `PlanHook`s (no
diffusers import here: the CLI's pre-checks read the family records in about the time of ``--help``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from xstage_dit import _diffusers_private as private
from xstage_dit.families import sharding


@dataclass
class SequenceState:
    """Per-forward bookkeeping shared by the hooks of one transformer: the full lengths that were
    split this forward (so the exit gather needs no size exchange)."""

    rank: int
    world: int
    group: Any
    totals: list[int] = field(default_factory=list)
    named: dict[str, Any] = field(default_factory=dict)  # model-specific facts (the family plans' hooks)

    def record(self, total: int) -> None:
        if total not in self.totals:
            self.totals.append(total)

    def total_for(self, local: int) -> int | None:
        """The recorded full length whose shard on this rank has `local` tokens, or None.

        The decision must be the same on every rank (it decides whether a size exchange, a
        collective, happens): a total is used only if no other recorded total could give a shard of
        the same size on any rank.
        """
        def possible(total: int) -> set[int]:
            return set(sharding.split_sizes(total, self.world))

        candidates = [t for t in self.totals if local in possible(t)]
        for t in self.totals:
            for u in self.totals:
                if t != u and possible(t) & possible(u):
                    return None  # ambiguous somewhere: exchange sizes (same decision on all ranks)
        return candidates[0] if len(candidates) == 1 else None


class PlanHook:
    """A hook of a family's plan on one module: diffusers' ``ModelHook`` protocol (``pre_forward`` returns the
    call's (args, kwargs), ``post_forward`` its output), which `apply_sequence_parallel` registers through a
    ``ModelHook``. Subclasses keep the shared `SequenceState` as ``self.state``."""

    def __init__(self, state: SequenceState | None = None) -> None:
        self.state = state

    def pre_forward(self, module, *args, **kwargs):
        return args, kwargs

    def post_forward(self, module, output):
        return output


@dataclass
class SequenceParallelSpec:
    """What `apply_sequence_parallel` needs from a model plan."""

    cp_plan: dict
    kv_layouts: dict[str, str] = field(default_factory=dict)  # module-name pattern -> layout
    # processor class -> factory, or "module:attribute" of one (resolved by the sequence-parallel feature)
    processor_swaps: dict[str, Callable[[Any], Any] | str] = field(default_factory=dict)
    # module-name pattern -> (state) -> a `PlanHook` (or a diffusers ModelHook) on each matching module
    extra_hooks: list[tuple[str, Callable[[SequenceState], Any]]] = field(default_factory=list)
    # attention modules that run before the split on whole sequences (left as they are)
    local_attention: tuple[str, ...] = ()


def shipped_plan(kv_layouts: dict[str, str] | None = None) -> Callable[[Any], SequenceParallelSpec]:
    """A plan builder for a transformer whose class ships a usable ``_cp_plan`` (diffusers' own plan), with
    the key/value layouts of its attentions under that plan (module-name pattern -> layout)."""
    def build(model) -> SequenceParallelSpec:
        plan = private.shipped_cp_plan(type(model))
        if not plan:
            raise ValueError(f"expected {type(model).__name__} to ship a _cp_plan, got none")
        return SequenceParallelSpec(cp_plan=dict(plan), kv_layouts=dict(kv_layouts or {}))

    return build


def rope_split(cpi, split_dim: int, expected_dims: int) -> dict:
    """The plan entry of a rotary-embedding module returning (cos, sin): both outputs split along split_dim."""
    return {i: cpi(split_dim=split_dim, expected_dims=expected_dims, split_output=True) for i in (0, 1)}


def blocks_of(model, name: str) -> int:
    """How many blocks ``model.<name>`` holds (a plan follows the model's own ``ModuleList``, never a literal);
    ValueError unless it is a non-empty ModuleList."""
    blocks = getattr(model, name, None)
    if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) == 0:
        raise ValueError(f"expected {type(model).__name__}.{name} to be a non-empty ModuleList, got {type(blocks).__name__}")
    return len(blocks)
