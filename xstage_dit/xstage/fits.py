"""Fits of the X-Stage parameters to measured sweeps, and the validation of a whole sweep (DESIGN §2).

``fit_drain_capacity`` (R and Q jointly from bursts that back up into an empty stage), ``fit_drain_rate``,
``fit_t_iss0`` / ``fit_t_iss0_free``, ``fit_capacity``, combined by ``fit_params``; ``validate`` predicts a gap
sweep from the params with no further fitted value and reports mean absolute percentage errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from xstage_dit.xstage.laws import (XStageParams, issue_time, period, isolated_issue_time)

__all__ = ["FitResult", "ParamsFit", "Validation", "fit_drain_rate", "fit_drain_capacity", "fit_t_iss0", "fit_t_iss0_free",
           "fit_capacity", "fit_params", "validate", "mape"]

@dataclass(frozen=True)
class FitResult:
    """A fitted value with its fit error.

    value: the fitted number (or tuple of numbers). rel_rms_error: RMS of the relative residuals of the
    fitted law over the points used. num_points: points used. note: how the value was obtained
    (e.g. "lower bound: never backed up").
    """

    value: float | tuple[float, ...]
    rel_rms_error: float
    num_points: int
    note: str = ""


def _as_points(name_x: str, xs: Sequence[float], name_y: str, ys: Sequence[float], min_points: int) -> tuple:
    xs, ys = [float(x) for x in xs], [float(y) for y in ys]
    if len(xs) != len(ys):
        raise ValueError(f"expected {name_x} and {name_y} of equal length, got {len(xs)} and {len(ys)}")
    if len(xs) < min_points:
        raise ValueError(f"expected at least {min_points} points, got {len(xs)}")
    for name, seq in ((name_x, xs), (name_y, ys)):
        bad = [v for v in seq if not (v > 0 and math.isfinite(v))]
        if bad:
            raise ValueError(f"expected {name} > 0 and finite, got {bad[0]!r}")
    return xs, ys


def _rel_rms(pred: Sequence[float], meas: Sequence[float]) -> float:
    return math.sqrt(sum(((p - m) / m) ** 2 for p, m in zip(pred, meas)) / len(meas))


def mape(pred: Sequence[float], meas: Sequence[float]) -> float:
    """Mean absolute percentage error (%) of ``pred`` against ``meas``."""
    if len(pred) != len(meas) or not meas:
        raise ValueError(f"expected equal non-empty lengths, got {len(pred)} and {len(meas)}")
    return 100.0 * sum(abs(p - m) / m for p, m in zip(pred, meas)) / len(meas)


def fit_drain_rate(volumes: Sequence[float], zero_gap_periods: Sequence[float]) -> FitResult:
    """R (bytes/s) from the steady period of zero-gap bursts, ``T_period = V / R``.

    Minimises the relative residuals: ``1/R = sum(V/T) / sum((V/T)^2)``. Pass only drain-limited
    points (large V); value is R in bytes/s.
    """
    vs, ts = _as_points("volumes", volumes, "zero_gap_periods", zero_gap_periods, 1)
    a = [v / t for v, t in zip(vs, ts)]
    inv_r = sum(a) / sum(x * x for x in a)
    r = 1.0 / inv_r
    return FitResult(r, _rel_rms([v / r for v in vs], ts), len(vs))


def _rel_line_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of the line ``y = c + m*x`` minimising ``sum(((c + m*x) - y) / y)^2``: least
    squares with weights ``1/y^2``. Needs at least two distinct x."""
    w = [1.0 / (y * y) for y in ys]
    sw = sum(w)
    swx = sum(wi * x for wi, x in zip(w, xs))
    swy = sum(wi * y for wi, y in zip(w, ys))
    swxx = sum(wi * x * x for wi, x in zip(w, xs))
    swxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * swxx - swx * swx
    return (swxx * swy - swx * swxy) / det, (sw * swxy - swx * swy) / det


def fit_t_iss0(volumes: Sequence[float], plateau_issue_times: Sequence[float]) -> FitResult:
    """``T_iss0(V) = t0 + V / issue_rate`` from large-gap (plateau) issue times.

    Weighted least squares on relative residuals; a negative intercept is clamped to 0 (issue time
    proportional to V), and one distinct volume gives the proportional fit. value = (t0_s, issue_rate_Bps).
    """
    vs, ts = _as_points("volumes", volumes, "plateau_issue_times", plateau_issue_times, 1)

    def proportional() -> FitResult:
        # T = V * b, relative residuals: b = sum(V/T) / sum((V/T)^2)
        a = [v / t for v, t in zip(vs, ts)]
        b = sum(a) / sum(x * x for x in a)
        return FitResult((0.0, 1.0 / b), _rel_rms([v * b for v in vs], ts), len(vs), "proportional")

    if len(set(vs)) < 2:
        return proportional()
    t0, b = _rel_line_fit(vs, ts)
    if t0 < 0 or b <= 0:
        if b <= 0 and t0 > 0:  # flat: issue time independent of V within noise
            t_mean = sum(1.0 / t for t in ts) / sum(1.0 / (t * t) for t in ts)  # relative-LS constant
            return FitResult((t_mean, math.inf), _rel_rms([t_mean] * len(ts), ts), len(vs), "constant")
        return proportional()
    return FitResult((t0, 1.0 / b), _rel_rms([t0 + b * v for v in vs], ts), len(vs), "affine")


def fit_t_iss0_free(
    volumes: Sequence[float],
    long_gap_issue_times: Sequence[float],
    *,
    backed_up_tol: float = 0.15,
    floor_s: float = 0.0,
    keep: Sequence[bool] | None = None,
) -> tuple[FitResult, list[bool]]:
    """``T_iss0(V)`` from the backpressure-free points among long-gap (or isolated) issue times of aligned
    bursts, which follow ``max(T_iss0(V), (V - Q)/R)``: only the volumes below the knee measure ``T_iss0``.

    Without ``keep``, the free points are the longest run of smallest volumes whose median issue time stays
    within ``(1 + backed_up_tol) * fit + floor_s`` of the affine fit through the smaller ones (the stage backs
    up only above a volume, never below it). ``keep`` (one flag per point) fixes the set instead (e.g. the
    points that pass the capacity bound once Q is known). Returns the fit (``fit_t_iss0`` on the kept points)
    and the flags.
    """
    vs, ts = _as_points("volumes", volumes, "long_gap_issue_times", long_gap_issue_times, 1)
    if keep is None:
        by_v: dict[float, list[float]] = {}
        for v, t in zip(vs, ts):
            by_v.setdefault(v, []).append(t)
        order = sorted(by_v)
        chosen = set(order[:2])
        for v in order[2:]:
            sel = [(x, t) for x, t in zip(vs, ts) if x in chosen]
            t0, ri = fit_t_iss0([x for x, _ in sel], [t for _, t in sel]).value
            med = sorted(by_v[v])[len(by_v[v]) // 2]
            if med > (1.0 + backed_up_tol) * (t0 + v / ri) + floor_s:
                break
            chosen.add(v)
        keep = [v in chosen for v in vs]
    keep = [bool(k) for k in keep]
    if len(keep) != len(vs) or not any(keep):
        raise ValueError(f"expected one keep flag per point and at least one kept, got {len(keep)} for {len(vs)}")
    fit = fit_t_iss0([v for v, k in zip(vs, keep) if k], [t for t, k in zip(ts, keep) if k])
    note = f"{fit.note} over {sum(keep)} backpressure-free points (V <= {max(v for v, k in zip(vs, keep) if k):.0f} B)"
    return FitResult(fit.value, fit.rel_rms_error, fit.num_points, note), keep


def _golden_min(f, lo: float, hi: float, iterations: int = 50) -> float:
    """The argument in [lo, hi] where the unimodal ``f`` is smallest, by golden-section search."""
    phi = (math.sqrt(5) - 1) / 2
    for _ in range(iterations):
        x1, x2 = hi - phi * (hi - lo), lo + phi * (hi - lo)
        if f(x1) <= f(x2):
            hi = x2
        else:
            lo = x1
    return (lo + hi) / 2


def fit_capacity(
    volumes: Sequence[float],
    isolated_issue_times: Sequence[float],
    params_without_q: XStageParams,
    *,
    backed_up_tol: float = 0.10,
) -> FitResult:
    """Q (bytes) from isolated-burst issue times, ``T_iss = max(T_iss0(V), (V - Q)/R)``.

    ``params_without_q`` supplies ``T_iss0`` and ``R`` (its capacity is ignored). A point counts as
    backed up when its issue time exceeds ``T_iss0(V)`` by more than ``backed_up_tol``. With no point
    backed up Q is only bounded below: value = ``max(V - R*T_iss0(V))`` over the sweep, note says so
    (callers may treat Q as unobserved). Otherwise Q minimises the relative squared error of the law
    over all points (dense scan + the per-point estimates ``V - R*T``).
    """
    vs, ts = _as_points("volumes", volumes, "isolated_issue_times", isolated_issue_times, 2)
    p = params_without_q
    r = p.drain_rate_Bps
    t0s = [p.t_iss0(v) for v in vs]
    backed = [i for i in range(len(vs)) if ts[i] > t0s[i] * (1.0 + backed_up_tol)]
    free_outstanding = max(max(v - r * t0, 0.0) for v, t0 in zip(vs, t0s))
    if not backed or math.isinf(r):
        pred = t0s
        return FitResult(free_outstanding, _rel_rms(pred, ts), len(vs),
                         "lower bound: no isolated burst backed up within the sweep")

    def err(q: float) -> float:
        return sum(((max(t0, (v - q) / r) - t) / t) ** 2 for v, t, t0 in zip(vs, ts, t0s))

    vmax = max(vs)
    candidates = [max(0.0, vs[i] - r * ts[i]) for i in backed]
    candidates += [vmax * i / 4000.0 for i in range(4001)]
    best = min(candidates, key=err)
    # refine around the best grid point by golden-section search on the bracket
    q = min((best, _golden_min(err, max(0.0, best - vmax / 4000.0), best + vmax / 4000.0, 60)), key=err)
    pred = [max(t0, (v - q) / r) for v, t0 in zip(vs, t0s)]
    return FitResult(q, _rel_rms(pred, ts), len(vs), f"knee fit over {len(backed)} backed-up points")


def fit_drain_capacity(
    volumes: Sequence[float],
    issue_times: Sequence[float],
    params_t_iss0: XStageParams,
    *,
    backed_up_tol: float = 0.10,
) -> tuple[FitResult, FitResult] | None:
    """R and Q together from the issue times of bursts that met an empty stage (isolated bursts and
    aligned bursts after a long gap), which follow ``T_iss = max(T_iss0(V), (V - Q)/R)``.

    ``params_t_iss0`` supplies ``T_iss0`` (its R and Q are ignored). The backed-up points (issue time above
    ``T_iss0(V)`` by more than ``backed_up_tol``) lie on the line ``T = V/R - Q/R``: a relative-weighted
    line fit through them gives the start, then R and Q are refined on the whole law over every point
    (a point near the knee may sit on either branch). Returns (R fit, Q fit), or None when fewer than two
    distinct backed-up volumes exist (R is then not observable from these bursts).

    Why not R from zero-gap periods: the aligned sweep's shortest gap is the producers' barrier, and
    where that barrier is longer than ``Q/R`` the stage empties during it, so the zero-gap period is
    ``(V - Q)/R + G``, not ``V/R`` (local HBM on the H200: 5 us barrier against Q/R ~ 0.3 us).
    """
    vs, ts = _as_points("volumes", volumes, "issue_times", issue_times, 2)
    t0s = [params_t_iss0.t_iss0(v) for v in vs]
    backed = [i for i in range(len(vs)) if ts[i] > t0s[i] * (1.0 + backed_up_tol)]
    if len({vs[i] for i in backed}) < 2:
        return None
    # T = b + a*V over the backed-up points (the line V/R - Q/R), minimising relative residuals.
    b, a = _rel_line_fit([vs[i] for i in backed], [ts[i] for i in backed])
    if a <= 0:
        return None  # issue time does not grow with V among the backed-up points: no drain rate to read

    def err(inv_r: float, q: float) -> float:
        return sum(((max(t0, (v - q) * inv_r) - t) / t) ** 2 for v, t, t0 in zip(vs, ts, t0s))

    # Refine (1/R, Q) by alternating golden-section searches around the line fit.
    inv_r, q = a, max(0.0, -b / a)
    vmax = max(vs)
    for _ in range(8):
        cand = _golden_min(lambda x: err(x, q), inv_r * 0.5, inv_r * 2.0)
        inv_r = min((inv_r, cand), key=lambda x: err(x, q))
        cand = _golden_min(lambda x: err(inv_r, x), 0.0, vmax)
        q = min((q, cand), key=lambda x: err(inv_r, x))
    rms = math.sqrt(err(inv_r, q) / len(vs))
    note = f"joint fit of R and Q on the isolated law over {len(vs)} points ({len(backed)} backed up)"
    return FitResult(1.0 / inv_r, rms, len(vs), note), FitResult(q, rms, len(vs), note)


@dataclass(frozen=True)
class ParamsFit:
    """``fit_params`` result: the params and each fit's error and note."""

    params: XStageParams
    drain: FitResult
    t_iss0: FitResult
    capacity: FitResult | None
    drain_zero_gap: FitResult | None = None  # R from zero-gap periods (V/R): a cross-check

    def errors(self) -> dict:
        out = {"R_rel_rms": self.drain.rel_rms_error, "t_iss0_rel_rms": self.t_iss0.rel_rms_error}
        if self.capacity is not None:
            out["Q_rel_rms"] = self.capacity.rel_rms_error
            out["Q_note"] = self.capacity.note
        return out


def fit_params(
    num_producers: int,
    *,
    zero_gap: tuple[Sequence[float], Sequence[float]],
    plateau: tuple[Sequence[float], Sequence[float]],
    isolated: tuple[Sequence[float], Sequence[float]] | None = None,
    capacity_if_unobserved: float = math.inf,
    backed_up_tol: float = 0.10,
) -> ParamsFit:
    """All three fits for aligned bursts. T_iss0 from the backpressure-free points of ``plateau = (volumes,
    long-gap issue_times)`` and ``isolated = (volumes, issue_times)`` (both follow ``max(T_iss0, (V - Q)/R)``);
    R and Q jointly from the backed-up ones (``fit_drain_capacity``). Where fewer than two volumes backed
    up, R comes from ``zero_gap = (volumes, periods)`` (``V/R``) and Q from the isolated knee (or
    ``capacity_if_unobserved`` when not given or when no isolated burst backed up). Once Q is known the free
    points are re-chosen by the capacity bound ``V - R*T_iss0(V) <= Q`` and the fits redone (a few rounds).
    ``drain_zero_gap`` keeps the zero-gap period estimate of R as a cross-check."""
    zero_gap_drain = fit_drain_rate(*zero_gap)
    drain = zero_gap_drain
    r = drain.value
    long_v = list(plateau[0]) + (list(isolated[0]) if isolated is not None else [])
    long_t = list(plateau[1]) + (list(isolated[1]) if isolated is not None else [])
    t_fit, keep = fit_t_iss0_free(long_v, long_t, backed_up_tol=max(backed_up_tol, 0.15))
    cap = None
    q = capacity_if_unobserved
    for _ in range(5):
        t0, ri = t_fit.value
        q = capacity_if_unobserved
        if isolated is None:
            break
        joint = fit_drain_capacity(long_v, long_t, XStageParams(num_producers, t0, ri, r, math.inf),
                                   backed_up_tol=backed_up_tol)
        if joint is not None:
            drain, cap = joint
            r, q = drain.value, cap.value
        else:
            drain, r = zero_gap_drain, zero_gap_drain.value
            cap = fit_capacity(isolated[0], isolated[1], XStageParams(num_producers, t0, ri, r, math.inf),
                               backed_up_tol=backed_up_tol)
            if cap.note.startswith("lower bound"):
                break
            q = cap.value
        p = XStageParams(num_producers, t0, ri, r, q)
        new_keep = [v - r * p.t_iss0(v) <= q * (1.0 + 1e-9) for v in long_v]
        if new_keep == keep or not any(new_keep):
            break
        keep = new_keep
        t_fit, _ = fit_t_iss0_free(long_v, long_t, keep=keep)
    t0, ri = t_fit.value
    return ParamsFit(XStageParams(num_producers, t0, ri, r, q), drain, t_fit, cap, zero_gap_drain)


@dataclass(frozen=True)
class Validation:
    """Prediction of measured sweeps from params alone: MAPE (%) of issue time and period over the
    gap sweep, and of issue time over the isolated sweep (None when that sweep is absent)."""

    mape_issue_pct: float
    mape_period_pct: float
    mape_isolated_pct: float | None
    num_points: int


def validate(
    params: XStageParams,
    gap_sweep: Sequence[tuple[float, float, float, float]],
    isolated_sweep: Sequence[tuple[float, float]] | None = None,
) -> Validation:
    """Predict every point of ``gap_sweep = [(V, G, measured_issue_s, measured_period_s), ...]`` and
    ``isolated_sweep = [(V, measured_issue_s), ...]`` with the laws; no value is refitted."""
    if not gap_sweep:
        raise ValueError("expected a non-empty gap_sweep, got none")
    pi = [issue_time(params, v, g) for v, g, _, _ in gap_sweep]
    pp = [period(params, v, g) for v, g, _, _ in gap_sweep]
    mi = mape(pi, [x[2] for x in gap_sweep])
    mp = mape(pp, [x[3] for x in gap_sweep])
    miso = None
    if isolated_sweep:
        miso = mape([isolated_issue_time(params, v) for v, _ in isolated_sweep], [x[1] for x in isolated_sweep])
    return Validation(mi, mp, miso, len(gap_sweep))
