"""What a calibration produced: fitted params per target, the machine it is valid for, the reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from xstage_dit.calibration.sweep import SWEEP_VERSION
from xstage_dit.calibration.targets import TARGETS
from xstage_dit.xstage import XStageParams

__all__ = ["CalibrationResult", "reference_result"]


@dataclass
class CalibrationResult:
    """params: fitted X-Stage params keyed by target. machine_key: what the cache is keyed on.
    source: "cache" | "measured" | "reference". reports: per target the fit errors, validation MAPEs,
    drain-limited flag, notes and the sweep data. elapsed_s: wall time of the measurement or load."""

    params: dict[str, XStageParams]
    machine_key: dict[str, Any]
    source: str
    reports: dict[str, dict] = field(default_factory=dict)
    elapsed_s: float = 0.0
    quick: bool = True
    path: str | None = None

    def to_json(self) -> dict:
        return {
            "sweep_version": SWEEP_VERSION,
            "machine_key": self.machine_key,
            "quick": self.quick,
            "elapsed_s": self.elapsed_s,
            "params": {t: p.to_dict() for t, p in self.params.items()},
            "targets": self.reports,
        }

    def summary(self) -> dict:
        """Headline numbers per target: R (GB/s), T_iss0 (us, at the largest gap-sweep volume), Q (MiB),
        MAPE of issue time and period over the gap sweep (%), drain_limited."""
        return {t: r["summary"] for t, r in self.reports.items()}



def reference_result() -> CalibrationResult:
    """The published reference point for every target, where nothing can be measured."""
    p = XStageParams.reference()
    return CalibrationResult({t: p for t in TARGETS}, {}, "reference")

