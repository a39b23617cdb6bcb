"""The fit of one target's sweep: ``T_iss0``, ``R`` and ``Q`` of the X-Stage model, and its validation.

``fit_sweep`` (pure, testable without a GPU) fits ``T_iss0`` on the plateau, ``R`` on the drain-limited
zero-gap points and ``Q`` on the isolated knee, then predicts every point of the gap sweep and of the
isolated sweep with no further fitted value (mean absolute percentage errors). A target whose issue
never backs up is reported as not drain-limited (``R`` and ``Q`` infinite, a lower bound on ``R``)
rather than fitted to noise.
"""

from __future__ import annotations

import math
from typing import Any

from xstage_dit.xstage import (XStageParams, fit_capacity, fit_drain_rate, fit_params, fit_t_iss0, fit_t_iss0_free,
                               isolated_issue_time, issue_time, mape, validate)

# A zero-gap issue time this much above T_iss0 means the drain, not issue, limits the period.
DRAIN_LIMITED_FACTOR = 1.25
# An isolated burst this much slower than T_iss0 has backed up.
BACKED_UP_TOL = 0.15

__all__ = ["DRAIN_LIMITED_FACTOR", "BACKED_UP_TOL", "fit_sweep"]


def _finite_or_none(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else x


def fit_sweep(sweep: dict) -> dict:
    """Fit and validate one target's sweep.

    sweep: ``{"target", "num_producers", "periodic": [{"volume_bytes", "gap_s", "issue_s", "period_s",
    "role": "zero"|"sweep"|"plateau", ...}], "isolated": [{"volume_bytes", "issue_s", ...}]}``.
    Returns ``{"params": XStageParams, "fit": {...errors, notes}, "validation": {...}, "drain_limited",
    "summary": {...}}``. Raises ValueError naming what is missing.
    """
    for key in ("target", "num_producers", "periodic", "isolated"):
        if key not in sweep:
            raise ValueError(f"expected sweep key {key!r}, got keys {sorted(sweep)}")
    k = int(sweep["num_producers"])
    periodic, isolated = sweep["periodic"], sweep["isolated"]
    plateau = [r for r in periodic if r["role"] == "plateau"]
    zero = [r for r in periodic if r["role"] == "zero"]
    if not plateau or not zero:
        raise ValueError(f"expected plateau and zero-gap points in the sweep, got {len(plateau)} and {len(zero)}")
    # Sweeps before SWEEP_VERSION 2 aligned only the first burst of a launch; the producers then free-ran.
    aligned = bool(sweep.get("aligned_every_burst", False))
    notes: list[str] = []

    if aligned:
        # Long-gap and isolated bursts both follow max(T_iss0, (V - Q)/R): T_iss0 only from those that did not
        # back up (re-chosen with the capacity bound once Q is known, in _fit_drain_limited).
        long_pts = plateau + list(isolated)
        t_fit, _ = fit_t_iss0_free([r["volume_bytes"] for r in long_pts], [r["issue_s"] for r in long_pts],
                                   backed_up_tol=BACKED_UP_TOL)
    else:
        # Free-running producers stagger after the first backed-up burst: their long-gap bursts never arrive
        # as one volume V and do not back up, so every plateau point is a free issue time.
        t_fit = fit_t_iss0([r["volume_bytes"] for r in plateau], [r["issue_s"] for r in plateau])
    t0_params = XStageParams(k, *t_fit.value, math.inf, math.inf)

    # Drain-limited volumes: at zero gap the issue time is well above the backpressure-free plateau.
    limited = [r for r in zero if r["issue_s"] > DRAIN_LIMITED_FACTOR * t0_params.t_iss0(r["volume_bytes"])]
    drain_limited = bool(limited)
    fit: dict[str, Any] = {"t_iss0_rel_rms": t_fit.rel_rms_error, "t_iss0_form": t_fit.note,
                           "t_iss0_points": t_fit.num_points, "aligned_every_burst": aligned}
    if drain_limited:
        params = _fit_drain_limited(t0_params, limited, plateau, isolated, aligned, fit, notes)
    else:
        r_lb = max(r["volume_bytes"] / r["period_s"] for r in zero)
        fit["R_lower_bound_Bps"] = r_lb
        notes.append(f"never drain-limited: at zero gap issue stays within {DRAIN_LIMITED_FACTOR}x of T_iss0 at every "
                     f"volume, so R (>= {r_lb / 1e9:.1f} GB/s, the zero-gap throughput) and Q are not observable "
                     "and are reported as unbounded; the target never backs up")
        params = t0_params

    # The gap sweep is predicted with the capacity-aware burst-gap law for aligned bursts. Free-running
    # producers (old sweeps) see the plain max law (Q = inf) at long gaps; their isolated sweep keeps Q.
    gap_params = params
    if not aligned:
        gap_params = _without_capacity(params)
        notes.append("free-running sweep (before SWEEP_VERSION 2: only the first burst of a launch was aligned): the "
                     "gap sweep is predicted with Q = inf, the isolated sweep with Q; near G = V/R the producers' "
                     "stagger smooths the issue time, which no fluid law with R, T_iss0, Q describes")
    validation = _validate_sweep(params, gap_params, periodic, isolated, limited, aligned,
                                 sweep.get("free_running") or [])

    v_ref = max(r["volume_bytes"] for r in periodic if r["role"] != "plateau")
    summary = {
        "R_GBps": _finite_or_none(params.drain_rate_Bps / 1e9),
        "t_iss0_us": params.t_iss0(v_ref) * 1e6,
        "t_iss0_volume_bytes": v_ref,
        "Q_MiB": _finite_or_none(params.capacity_bytes / (1024 * 1024)),
        "mape_issue_pct": validation["mape_issue_pct"],
        "mape_period_pct": validation["mape_period_pct"],
        "mape_isolated_pct": validation["mape_isolated_pct"],
        "issue_err_over_period_pct": validation["mean_issue_err_over_period_pct"],
        "drain_limited": drain_limited,
    }
    if not drain_limited:
        summary["R_lower_bound_GBps"] = fit["R_lower_bound_Bps"] / 1e9
    return {"params": params, "fit": fit, "validation": validation, "drain_limited": drain_limited,
            "notes": notes, "summary": summary}


def _without_capacity(params: XStageParams) -> XStageParams:
    """The same target under the plain max law (Q = inf)."""
    return XStageParams(params.num_producers, params.t_iss0_fixed_s, params.issue_rate_Bps, params.drain_rate_Bps,
                        math.inf)


def _fit_drain_limited(t0_params: XStageParams, limited: list[dict], plateau: list[dict], isolated: list[dict],
                       aligned: bool, fit: dict, notes: list[str]) -> XStageParams:
    """R (and Q where the isolated sweep shows it) of a drain-limited target; `t0_params` holds the plateau's
    T_iss0, refitted here for aligned sweeps. Adds the fit errors to `fit` and what was not measured to
    `notes`."""
    k = t0_params.num_producers
    t0_fixed, issue_rate = t0_params.t_iss0_fixed_s, t0_params.issue_rate_Bps
    # R from the larger half of the drain-limited volumes (DESIGN §2: "fit over large V"), where
    # per-burst fixed costs are negligible against V/R.
    vols = sorted(r["volume_bytes"] for r in limited)
    large = [r for r in limited if r["volume_bytes"] >= vols[(len(vols) - 1) // 2]]
    zg = ([r["volume_bytes"] for r in large], [r["period_s"] for r in large])
    if aligned and len(isolated) >= 2:
        pf = fit_params(k, zero_gap=zg, plateau=([r["volume_bytes"] for r in plateau], [r["issue_s"] for r in plateau]),
                        isolated=([r["volume_bytes"] for r in isolated], [r["issue_s"] for r in isolated]),
                        backed_up_tol=BACKED_UP_TOL)
        d_fit, t_fit, c_fit = pf.drain, pf.t_iss0, pf.capacity
        t0_fixed, issue_rate = t_fit.value
        fit.update(t_iss0_rel_rms=t_fit.rel_rms_error, t_iss0_form=t_fit.note, t_iss0_points=t_fit.num_points,
                   R_note=d_fit.note or "zero-gap periods (V/R)")
        if pf.drain_zero_gap is not None and pf.drain_zero_gap is not d_fit:
            # Cross-check only: the zero-gap period is V/R only while the barrier gap is shorter than Q/R.
            fit["R_zero_gap_period_GBps"] = pf.drain_zero_gap.value / 1e9
    else:
        d_fit = fit_drain_rate(*zg)
        c_fit = None
        if len(isolated) >= 2:
            c_fit = fit_capacity([r["volume_bytes"] for r in isolated], [r["issue_s"] for r in isolated],
                                 XStageParams(k, t0_fixed, issue_rate, d_fit.value, math.inf),
                                 backed_up_tol=BACKED_UP_TOL)
    fit.update(R_rel_rms=d_fit.rel_rms_error, R_points=d_fit.num_points)
    q = math.inf
    if c_fit is not None:
        fit.update(Q_rel_rms=c_fit.rel_rms_error, Q_note=c_fit.note)
        if c_fit.note.startswith("lower bound"):
            fit["Q_lower_bound_bytes"] = c_fit.value
            notes.append(f"no isolated burst backed up up to {max(r['volume_bytes'] for r in isolated)} bytes: "
                         f"Q >= {c_fit.value:.0f} bytes, reported as unbounded")
        else:
            q = c_fit.value
    else:
        notes.append("no isolated sweep: Q not measured")
    return XStageParams(k, t0_fixed, issue_rate, d_fit.value, q)


def _validate_sweep(params: XStageParams, gap_params: XStageParams, periodic: list[dict], isolated: list[dict],
                    limited: list[dict], aligned: bool, free: list[dict]) -> dict:
    """Every point of the gap sweep (with `gap_params`) and of the isolated sweep (with `params`) predicted with
    no further fitted value: MAPEs, the issue error relative to the period, the worst points, the drain-limited
    volumes alone, and the free-running diagnostic where the sweep has one."""
    gap_points = [(r["volume_bytes"], max(r["gap_s"], 0.0), r["issue_s"], r["period_s"]) for r in periodic]
    iso_points = [(r["volume_bytes"], r["issue_s"]) for r in isolated]
    val = validate(gap_params, gap_points, None)
    mape_iso = mape([isolated_issue_time(params, v) for v, _ in iso_points], [t for _, t in iso_points]) \
        if iso_points else None
    validation = {"mape_issue_pct": val.mape_issue_pct, "mape_period_pct": val.mape_period_pct,
                  "mape_isolated_pct": mape_iso, "num_points": val.num_points,
                  "law": "capacity-aware burst-gap law" if aligned else "max law (Q = inf) for free-running bursts"}
    # The issue time near G* is a small difference (V/R - G): its relative error is large even where the
    # period is right. Also report the issue error relative to the period, and the worst points.
    rel = []
    for v, g, mi, mp in gap_points:
        pi = issue_time(gap_params, v, g)
        rel.append((abs(pi - mi) / mi, abs(pi - mi) / mp, v, g, mi, pi))
    validation["mean_issue_err_over_period_pct"] = 100.0 * sum(r[1] for r in rel) / len(rel)
    validation["worst_issue_points"] = [
        {"volume_bytes": r[2], "gap_s": r[3], "issue_s": r[4], "predicted_issue_s": r[5], "ape_pct": 100 * r[0]}
        for r in sorted(rel, reverse=True)[:5]]
    if limited:
        lim_vols = {r["volume_bytes"] for r in limited}
        sub = [p for p in gap_points if p[0] in lim_vols]
        v2 = validate(gap_params, sub)
        validation.update(mape_issue_drain_limited_pct=v2.mape_issue_pct,
                          mape_period_drain_limited_pct=v2.mape_period_pct, drain_limited_volumes=sorted(lim_vols))

    if free and math.isfinite(params.drain_rate_Bps):
        # Diagnostic only (not fitted, not in the MAPEs above): the same volume with free-running producers.
        fpts = [(r["volume_bytes"], max(r["gap_s"], 0.0), r["issue_s"], r["period_s"]) for r in free]
        max_law = validate(_without_capacity(params), fpts)
        validation["free_running"] = {
            "volume_bytes": fpts[0][0], "num_points": len(fpts),
            "mape_issue_aligned_law_pct": validate(params, fpts).mape_issue_pct,
            "mape_issue_max_law_pct": max_law.mape_issue_pct,
            "mape_period_max_law_pct": max_law.mape_period_pct,
            "note": "free-running producers (only the first burst aligned) at one volume, predicted with the "
                    "aligned-burst law and with Q = inf; not used by the fit"}
    return validation
