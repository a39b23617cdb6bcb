"""``ScheduleChoice``, what every chooser returns, and the MoE chooser's entry point.

Each op's chooser lives in its own module (`attention`: fused/serial Ulysses attention; `moe_tiles`: the
MoE combine order and lead). Without a calibration (``xparams=None``, e.g. on the CPU) a chooser still
returns a choice whose reason says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ScheduleChoice:
    """The schedule an op runs and why.

    name: the schedule ("fused" | "serial" for attention, "wave" | "interleaved" for MoE combine...).
    reason: one line a user can read in a log: the design-test outcome or why no test was possible.
    params: schedule parameters (e.g. ``{"lead": 2}`` for the interleaved MoE combine).
    """

    name: str
    reason: str
    params: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------ MoE combine


def choose_moe_lead(xparams, **shape) -> ScheduleChoice:
    """(Kept for ``ops.moe``'s callers; the chooser lives in `moe_tiles`, importable from ``xstage_dit.schedule``.)
    Wave-by-wave or interleaved MoE combine and its lead ``D``; see ``xstage_dit.schedule.moe_tiles.choose_moe_lead``."""
    from xstage_dit.schedule.moe_tiles import choose_moe_lead as _choose

    return _choose(xparams, **shape)
