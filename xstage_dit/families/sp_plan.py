"""The vocabulary of a family's sequence-parallel plan: `SequenceParallelSpec` (what a family record's plan
builds for `features.sequence_parallel.apply_sequence_parallel`) and `SequenceState` (the per-forward facts the
plan's hooks share). Processor swaps and EP layers are named as ``"module:attribute"`` strings, resolved by the
feature that applies them, so a family file never imports a feature."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from xstage_dit.families import sharding

if TYPE_CHECKING:  # only a type here: importing diffusers costs seconds that the CLI's pre-checks must not pay
    from diffusers.hooks import ModelHook


@dataclass
class SequenceState:
    """Per-forward bookkeeping shared by the hooks of one transformer: the full lengths that were
    split this forward (so the exit gather needs no size exchange)."""

    rank: int
    world: int
    group: Any
    totals: list[int] = field(default_factory=list)
    named: dict[str, Any] = field(default_factory=dict)  # model-specific facts (plans.py hooks)

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


@dataclass
class SequenceParallelSpec:
    """What `apply_sequence_parallel` needs from a model plan."""

    cp_plan: dict
    kv_layouts: dict[str, str] = field(default_factory=dict)  # module-name pattern -> layout
    # processor class -> factory, or "module:attribute" of one (resolved by the sequence-parallel feature)
    processor_swaps: dict[str, Callable[[Any], Any] | str] = field(default_factory=dict)
    extra_hooks: list[tuple[str, Callable[[SequenceState], "ModelHook"]]] = field(default_factory=list)
    # attention modules that run before the split on whole sequences (left as they are)
    local_attention: tuple[str, ...] = ()
