"""The X-Stage model of remote-store backpressure (DESIGN §2), pure Python.

A remote store is *accepted* by the issuing SM long before it is *visible* at the destination; in
between it sits in a finite post-issue stage. Three measured numbers describe that stage as software
sees it, for a fixed producer count ``K``:

- ``T_iss0(V) = t_iss0_fixed_s + V / issue_rate_Bps``: backpressure-free issue time of a burst of
  ``V`` bytes (all ``K`` producers together), the plateau of the issue time at long gaps;
- ``R = drain_rate_Bps``: effective drain rate, and
- ``Q = capacity_bytes``: effective outstanding capacity, both from the bursts that back up into an empty
  stage (isolated, or aligned after a long gap: ``T_iss = (V - Q)/R`` above the knee); zero-gap periodic
  bursts (``T_period = V / R``) give R where fewer than two volumes back up.

Laws (``G`` = gap of useful work between a producer's bursts, seconds; bursts aligned across producers):

- burst-gap law:      ``T_iss    = max(T_iss0(V), V/R - min(G, Q/R))``
- period:             ``T_period = T_iss + G``  (``= max(V/R, T_iss0(V) + G)`` while ``G <= Q/R``; the naive
                      sum ``T_iss0 + G + V/R`` is wrong)
- recovery gap:       ``G*       = V/R - T_iss0(V)``           (``G >= G*`` => issue at ``T_iss0`` if V fits Q)
- isolated burst:     ``T_iss    = max(T_iss0(V), (V - Q)/R)``  (free while ``V - R*T_iss0(V) <= Q``)
- design test:        rate bound ``G >= G*`` and capacity bound ``V - R*T_iss0(V) <= Q``

The burst-gap law is the fluid steady state of a stage of capacity Q drained at R: a backed-up burst
leaves the stage full (Q), the gap drains ``min(Q, R*G)`` of it, so the next burst is accepted
``V/R - min(G, Q/R)`` after it starts. Its two limits are DESIGN §2's laws: ``max(T_iss0, V/R - G)`` while
the gap is shorter than ``Q/R`` (the stage never empties) and the isolated-burst law once it is longer
(every burst meets an empty stage); and it is at ``T_iss0`` exactly when the design test passes. With
``Q = inf`` it is the plain max law, which is what producers that free-run (not aligned per burst) see at
long gaps: their bursts stagger and never arrive as one volume V.

The fits (``fit_drain_capacity``, ``fit_drain_rate``, ``fit_t_iss0`` / ``fit_t_iss0_free``, ``fit_capacity``, combined by
``fit_params``) turn the three measured sweeps into ``XStageParams`` (T_iss0 only from bursts that did not
back up: for aligned bursts a long gap does not make a burst of ``V > V_knee`` free); ``validate`` predicts a whole gap sweep from the params
with no further fitted value and reports the mean absolute percentage errors.

Example::

    p = XStageParams.reference()
    design_test(p, volume_bytes=148 * 32 * 1024, gap_s=7e-6).ok   # True: G >= G* (6.0 us), V - R*T0 <= Q
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

KIB = 1024
MIB = 1024 * 1024

__all__ = [
    "KIB",
    "MIB",
    "XStageParams",
    "DesignTest",
    "issue_time",
    "period",
    "naive_period",
    "isolated_issue_time",
    "knee_volume",
    "design_test",
]


def _check_positive(name: str, value: float, *, allow_zero: bool = False, allow_inf: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not math.isnan(value)
    ok = ok and (value >= 0 if allow_zero else value > 0)
    ok = ok and (allow_inf or not math.isinf(value))
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"expected {name} {bound} and finite, got {value!r}")


@dataclass(frozen=True)
class XStageParams:
    """The three X-Stage numbers for one producer count and one target.

    num_producers: K, the producers (CTAs) issuing one burst together.
    t_iss0_fixed_s, issue_rate_Bps: ``T_iss0(V) = t_iss0_fixed_s + V / issue_rate_Bps`` seconds.
    drain_rate_Bps: R, bytes per second the stage drains.
    capacity_bytes: Q, bytes the stage holds outstanding before issue stalls (``inf`` = never seen
        to back up within the measured volumes).
    """

    num_producers: int
    t_iss0_fixed_s: float
    issue_rate_Bps: float
    drain_rate_Bps: float
    capacity_bytes: float

    def __post_init__(self) -> None:
        if not isinstance(self.num_producers, int) or self.num_producers < 1:
            raise ValueError(f"expected num_producers >= 1 (an int), got {self.num_producers!r}")
        _check_positive("t_iss0_fixed_s", self.t_iss0_fixed_s, allow_zero=True)
        _check_positive("issue_rate_Bps", self.issue_rate_Bps, allow_inf=True)
        _check_positive("drain_rate_Bps", self.drain_rate_Bps, allow_inf=True)
        _check_positive("capacity_bytes", self.capacity_bytes, allow_zero=True, allow_inf=True)

    def t_iss0(self, volume_bytes: float) -> float:
        """Backpressure-free issue time (s) of a burst of ``volume_bytes``: ``t0 + V / issue_rate``."""
        _check_positive("volume_bytes", volume_bytes, allow_zero=True)
        return self.t_iss0_fixed_s + volume_bytes / self.issue_rate_Bps

    def recovery_gap(self, volume_bytes: float) -> float:
        """``G* = V/R - T_iss0(V)`` seconds; a gap ``G >= G*`` leaves issue at ``T_iss0`` (may be < 0)."""
        return volume_bytes / self.drain_rate_Bps - self.t_iss0(volume_bytes)

    def to_dict(self) -> dict:
        """JSON-friendly dict (``inf`` becomes the string ``"inf"``)."""
        return {k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict) -> "XStageParams":
        """Inverse of ``to_dict``."""
        fields = ("num_producers", "t_iss0_fixed_s", "issue_rate_Bps", "drain_rate_Bps", "capacity_bytes")
        missing = [f for f in fields if f not in data]
        if missing:
            raise ValueError(f"expected XStageParams fields {fields}, got a dict missing {missing}")
        vals = {f: (math.inf if data[f] == "inf" else float(data[f])) for f in fields[1:]}
        return cls(num_producers=int(data["num_producers"]), **vals)

    @classmethod
    def reference(cls) -> "XStageParams":
        """The published reference point (8-GPU NVLink system, 148 SMs): R = 717 GB/s,
        T_iss0 = 0.76 us at K = 148, V = 148 * 32 KiB, Q = 4.25 MiB.

        Only one (V, T_iss0) pair is published, so the issue time is taken proportional to V
        (``t_iss0_fixed_s = 0``); with it the published knee (~33 KiB per producer, ~4.77 MiB) gives
        ``Q = V_knee - R*T_iss0(V_knee)`` ~= 4.25 MiB. Use only where no calibration exists.
        """
        k = 148
        v_ref = k * 32 * KIB
        return cls(
            num_producers=k,
            t_iss0_fixed_s=0.0,
            issue_rate_Bps=v_ref / 0.76e-6,
            drain_rate_Bps=717e9,
            capacity_bytes=4.25 * MIB,
        )


# ----------------------------------------------------------------------------------------------- laws


def issue_time(params: XStageParams, volume_bytes: float, gap_s: float) -> float:
    """Steady-state issue time (s) of periodic aligned bursts: ``max(T_iss0(V), V/R - min(G, Q/R))``.

    ``Q = inf`` gives the max law ``max(T_iss0(V), V/R - G)``; ``G -> inf`` gives the isolated-burst law.
    Example: ``issue_time(XStageParams(132, 0, 7e12, 59e9, 4e6), 8.65e6, 0.0)`` = V/R = 146.6e-6.
    """
    _check_positive("gap_s", gap_s, allow_zero=True)
    r, q = params.drain_rate_Bps, params.capacity_bytes
    drained_s = gap_s if math.isinf(q) else min(gap_s, q / r)
    return max(params.t_iss0(volume_bytes), volume_bytes / r - drained_s)


def period(params: XStageParams, volume_bytes: float, gap_s: float) -> float:
    """Steady-state period (s) of periodic aligned bursts: ``issue_time + G``, i.e. ``max(V/R, T_iss0(V) + G)``
    while ``G <= Q/R`` (the gap overlaps with draining) and ``(V - Q)/R + G`` beyond (the stage empties
    during the gap and the drain idles)."""
    return issue_time(params, volume_bytes, gap_s) + gap_s


def naive_period(params: XStageParams, volume_bytes: float, gap_s: float) -> float:
    """The completion-coupled sum ``T_iss0(V) + G + V/R`` that measurements refute (for plots)."""
    _check_positive("gap_s", gap_s, allow_zero=True)
    return params.t_iss0(volume_bytes) + gap_s + volume_bytes / params.drain_rate_Bps


def isolated_issue_time(params: XStageParams, volume_bytes: float) -> float:
    """Issue time (s) of one burst into an empty stage: ``T_iss0(V)`` while the outstanding volume
    ``V - R*T_iss0(V)`` fits ``Q``, else ``(V - Q)/R``; i.e. ``max(T_iss0(V), (V - Q)/R)``."""
    t0 = params.t_iss0(volume_bytes)
    if math.isinf(params.capacity_bytes):
        return t0
    return max(t0, (volume_bytes - params.capacity_bytes) / params.drain_rate_Bps)


def knee_volume(params: XStageParams) -> float:
    """The burst volume (bytes) where isolated bursts start to back up: ``V - R*T_iss0(V) = Q``.
    ``inf`` when it never does (infinite Q, or drain at least as fast as issue)."""
    r, ri = params.drain_rate_Bps, params.issue_rate_Bps
    if math.isinf(params.capacity_bytes) or math.isinf(r) or r >= ri:
        return math.inf
    return (params.capacity_bytes + r * params.t_iss0_fixed_s) / (1.0 - r / ri)


@dataclass(frozen=True)
class DesignTest:
    """Outcome of the design test for a recurring burst pattern.

    ok: both bounds hold (no modelled backpressure).
    rate_ok: ``G >= G*``; rate_deficit_s = ``max(0, G* - G)`` seconds of gap missing.
    capacity_ok: ``V - R*T_iss0(V) <= Q``; capacity_excess_bytes = ``max(0, V - R*T_iss0(V) - Q)``.
    recovery_gap_s: ``G*``. reason: one line saying which bound fails and by how much.
    """

    ok: bool
    rate_ok: bool
    capacity_ok: bool
    recovery_gap_s: float
    rate_deficit_s: float
    capacity_excess_bytes: float
    reason: str


def design_test(params: XStageParams, volume_bytes: float, gap_s: float) -> DesignTest:
    """Check both bounds for bursts of ``volume_bytes`` separated by ``gap_s`` of work per producer."""
    _check_positive("volume_bytes", volume_bytes, allow_zero=True)
    _check_positive("gap_s", gap_s, allow_zero=True)
    g_star = params.recovery_gap(volume_bytes)
    rate_deficit = max(0.0, g_star - gap_s)
    outstanding = volume_bytes - params.drain_rate_Bps * params.t_iss0(volume_bytes)
    excess = max(0.0, outstanding - params.capacity_bytes)
    rate_ok, cap_ok = rate_deficit <= 0.0, excess <= 0.0
    parts = []
    if not rate_ok:
        parts.append(f"rate bound fails: gap {gap_s * 1e6:.3f} us < G* {g_star * 1e6:.3f} us "
                     f"(short by {rate_deficit * 1e6:.3f} us)")
    if not cap_ok:
        parts.append(f"capacity bound fails: outstanding {outstanding / MIB:.3f} MiB > Q "
                     f"{params.capacity_bytes / MIB:.3f} MiB (over by {excess / MIB:.3f} MiB)")
    if not parts:
        parts.append(f"both bounds hold: gap {gap_s * 1e6:.3f} us >= G* {g_star * 1e6:.3f} us and outstanding "
                     f"{max(outstanding, 0.0) / MIB:.3f} MiB <= Q {params.capacity_bytes / MIB:.3f} MiB")
    return DesignTest(
        ok=rate_ok and cap_ok,
        rate_ok=rate_ok,
        capacity_ok=cap_ok,
        recovery_gap_s=g_star,
        rate_deficit_s=rate_deficit,
        capacity_excess_bytes=excess,
        reason="; ".join(parts),
    )
