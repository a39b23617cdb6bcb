"""``ScheduleChoice``, what every chooser returns.

Each op's chooser lives in its own module (`attention`: fused/serial Ulysses attention; `moe`: the MoE
path, combine order and lead). Without a calibration (``xparams=None``, e.g. on the CPU) a chooser still
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


