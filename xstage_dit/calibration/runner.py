"""Startup calibration: measure remote-store issue, drain and capacity on this machine, fit the X-Stage
model (``xstage_dit.xstage``), validate the fit, cache it per machine.

Per target ("local" HBM = the control, "host" = host-pinned memory over PCIe, "nvlink" = a peer GPU's
memory) the burst kernel (``csrc/burst.cu``) runs three sweeps with ``K`` producers (one per SM):

- periodic bursts at every gap-sweep volume: zero gap (role "zero": ``T_period = V/R`` where the drain
  limits), gaps as fractions of that zero-gap period (role "sweep"), and long gaps (role "plateau":
  ``T_iss0``); plateau and zero-gap points are also taken at every isolated-sweep volume;
- isolated bursts (one burst per launch, so the stage starts drained) over volumes around the knee.

``fit_sweep`` (pure, testable without a GPU) fits ``T_iss0`` on the plateau, ``R`` on the drain-limited
zero-gap points and ``Q`` on the isolated knee, then predicts every point of the gap sweep and of the
isolated sweep with no further fitted value (mean absolute percentage errors). A target whose issue
never backs up is reported as not drain-limited (``R`` and ``Q`` infinite, a lower bound on ``R``)
rather than fitted to noise.

Public API::

    result = load_or_calibrate()          # cache hit: a file read; miss: measure (quick) and store
    result.params["host"].drain_rate_Bps
    params = xstage_dit.calibrate(target="host", quick=False)   # dict[target, XStageParams]
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from xstage_dit.xstage import (
    KIB,
    XStageParams,
    fit_capacity,
    fit_drain_rate,
    fit_params,
    fit_t_iss0,
    fit_t_iss0_free,
    isolated_issue_time,
    issue_time,
    mape,
    validate,
)

log = logging.getLogger(__name__)

# Bump when the sweep or the fit changes meaning: cached results of another version are recalibrated.
# 2: every periodic burst starts aligned across producers (1: only the first; the rest free-ran).
SWEEP_VERSION = 2
TARGETS = ("local", "host", "nvlink")
# A zero-gap issue time this much above T_iss0 means the drain, not issue, limits the period.
DRAIN_LIMITED_FACTOR = 1.25
# An isolated burst this much slower than T_iss0 has backed up.
BACKED_UP_TOL = 0.15

__all__ = [
    "CalibrationUnavailable",
    "CalibrationConfig",
    "CalibrationResult",
    "SweepPlan",
    "TARGETS",
    "calibrate",
    "load_or_calibrate",
    "run_calibration",
    "fit_sweep",
    "machine_key",
    "cache_path",
    "load_cache",
    "save_cache",
]


class CalibrationUnavailable(RuntimeError):
    """No calibration can run here (no GPU, no nvcc, target missing on this machine)."""


# ------------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class SweepPlan:
    """What one target's calibration measures.

    gap_kib: bytes per producer (KiB) of the gap sweeps. gap_fractions: gaps as fractions of the
    zero-gap period at that volume. plateau_fractions: long gaps (fractions of the zero-gap period)
    whose issue time is the backpressure-free plateau. isolated_kib: bytes per producer of the isolated
    sweep. num_bursts / warmup_bursts: bursts per periodic launch / dropped from its start.
    repeats / isolated_repeats: launches per point (median). free_running_kib: one volume also swept with
    free-running producers (only the first burst aligned, as real kernels without a barrier run), reported
    beside the fit and not used by it; None skips it.
    """

    gap_kib: tuple[int, ...]
    gap_fractions: tuple[float, ...]
    plateau_fractions: tuple[float, ...]
    isolated_kib: tuple[int, ...]
    num_bursts: int = 20
    warmup_bursts: int = 4
    repeats: int = 3
    isolated_repeats: int = 5
    free_running_kib: int | None = None

    def __post_init__(self) -> None:
        for name in ("gap_kib", "isolated_kib"):
            vals = getattr(self, name)
            if not vals or any((not isinstance(v, int)) or v <= 0 or (v * KIB) % 16 for v in vals):
                raise ValueError(f"expected {name} a non-empty tuple of positive KiB counts, got {vals!r}")
        if not self.gap_fractions or any(f < 0 for f in self.gap_fractions):
            raise ValueError(f"expected gap_fractions >= 0, got {self.gap_fractions!r}")
        if not self.plateau_fractions or min(self.plateau_fractions) < 1.5:
            raise ValueError(f"expected plateau_fractions >= 1.5 (beyond the recovery gap), got {self.plateau_fractions!r}")
        if self.num_bursts <= self.warmup_bursts + 1:
            raise ValueError(f"expected num_bursts > warmup_bursts + 1, got {self.num_bursts} and {self.warmup_bursts}")
        if self.repeats < 1 or self.isolated_repeats < 1:
            raise ValueError(f"expected repeats >= 1, got {self.repeats} and {self.isolated_repeats}")

    @property
    def max_kib(self) -> int:
        return max(max(self.gap_kib), max(self.isolated_kib))


# Gaps as fractions of the zero-gap period, evenly spaced across both regimes (drain-limited below ~1,
# issue-limited above).
_FINE_GAPS = tuple(i / 8 for i in range(17))
_QUICK_GAPS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
# Remote targets: the knee sits near 32 KiB per producer on the reference system and on the H200 over
# PCIe (DESIGN §4), so the isolated sweep is dense there.
_REMOTE_ISO_FULL = (4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 48, 56, 64, 80, 96, 128, 160, 192, 256)
_REMOTE_ISO_QUICK = (8, 16, 24, 32, 40, 48, 64, 96, 128, 192)
_LOCAL_ISO_FULL = (16, 32, 64, 128, 256, 512, 768, 1024)
_LOCAL_ISO_QUICK = (32, 128, 512, 1024)

PLANS: dict[tuple[str, bool], SweepPlan] = {
    ("local", False): SweepPlan((64, 256, 1024), _FINE_GAPS, (2.0, 3.0), _LOCAL_ISO_FULL, free_running_kib=256),
    ("local", True): SweepPlan((256, 1024), _QUICK_GAPS, (2.0,), _LOCAL_ISO_QUICK, num_bursts=14, repeats=1,
                               isolated_repeats=3),
    ("remote", False): SweepPlan((16, 32, 64, 128, 256), _FINE_GAPS, (2.0, 3.0), _REMOTE_ISO_FULL, free_running_kib=64),
    ("remote", True): SweepPlan((32, 128), _QUICK_GAPS, (2.0,), _REMOTE_ISO_QUICK, num_bursts=14, repeats=1,
                                isolated_repeats=3),
}


def plan_for(target: str, quick: bool) -> SweepPlan:
    _check_target(target)
    return PLANS[("local" if target == "local" else "remote", bool(quick))]


def _check_target(target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"expected a target in {TARGETS}, got {target!r}")


@dataclass(frozen=True)
class CalibrationConfig:
    """How ``load_or_calibrate`` / ``calibrate`` run.

    target: "auto" (every target this machine has: local, host, and nvlink with >= 2 peer GPUs), one
    of ``TARGETS``, or a comma-separated list. quick: the start-up plan (seconds) instead of the full
    one. num_producers: K (None = one per SM). threads: per producer. cache_dir: where results are
    cached (None = ``$XSTAGE_DIT_CACHE`` or ``~/.cache/xstage_dit``). force: measure even on a cache
    hit. allow_shared_gpu: let the nvlink target run with two processes sharing one GPU (tests).
    """

    target: str = "auto"
    quick: bool = True
    num_producers: int | None = None
    threads: int = 512
    cache_dir: str | None = None
    force: bool = False
    allow_shared_gpu: bool = False

    def __post_init__(self) -> None:
        if self.target != "auto":
            for t in self.target.split(","):
                _check_target(t.strip())
        if self.num_producers is not None and (not isinstance(self.num_producers, int) or self.num_producers < 1):
            raise ValueError(f"expected num_producers >= 1 (or None for one per SM), got {self.num_producers!r}")
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"expected threads a multiple of 32 in [32, 1024], got {self.threads}")


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


# ------------------------------------------------------------------------------------------ the fit


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
        # back up (re-chosen with the capacity bound once Q is known, below).
        long_pts = plateau + list(isolated)
        t_fit, _ = fit_t_iss0_free([r["volume_bytes"] for r in long_pts], [r["issue_s"] for r in long_pts],
                                   backed_up_tol=BACKED_UP_TOL)
    else:
        # Free-running producers stagger after the first backed-up burst: their long-gap bursts never arrive
        # as one volume V and do not back up, so every plateau point is a free issue time.
        t_fit = fit_t_iss0([r["volume_bytes"] for r in plateau], [r["issue_s"] for r in plateau])
    t0_fixed, issue_rate = t_fit.value
    t0_params = XStageParams(k, t0_fixed, issue_rate, math.inf, math.inf)

    # Drain-limited volumes: at zero gap the issue time is well above the backpressure-free plateau.
    limited = [r for r in zero if r["issue_s"] > DRAIN_LIMITED_FACTOR * t0_params.t_iss0(r["volume_bytes"])]
    drain_limited = bool(limited)
    fit: dict[str, Any] = {"t_iss0_rel_rms": t_fit.rel_rms_error, "t_iss0_form": t_fit.note,
                           "t_iss0_points": t_fit.num_points, "aligned_every_burst": aligned}
    if drain_limited:
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
        r_bps = d_fit.value
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
        params = XStageParams(k, t0_fixed, issue_rate, r_bps, q)
    else:
        r_lb = max(r["volume_bytes"] / r["period_s"] for r in zero)
        fit["R_lower_bound_Bps"] = r_lb
        notes.append(f"never drain-limited: at zero gap issue stays within {DRAIN_LIMITED_FACTOR}x of T_iss0 at every "
                     f"volume, so R (>= {r_lb / 1e9:.1f} GB/s, the zero-gap throughput) and Q are not observable "
                     "and are reported as unbounded; the target never backs up")
        params = XStageParams(k, t0_fixed, issue_rate, math.inf, math.inf)

    # The gap sweep is predicted with the capacity-aware burst-gap law for aligned bursts. Free-running
    # producers (old sweeps) see the plain max law (Q = inf) at long gaps; their isolated sweep keeps Q.
    gap_params = params
    if not aligned:
        gap_params = XStageParams(k, t0_fixed, issue_rate, params.drain_rate_Bps, math.inf)
        notes.append("free-running sweep (before SWEEP_VERSION 2: only the first burst of a launch was aligned): the "
                     "gap sweep is predicted with Q = inf, the isolated sweep with Q; near G = V/R the producers' "
                     "stagger smooths the issue time, which no fluid law with R, T_iss0, Q describes")

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
    if drain_limited:
        lim_vols = {r["volume_bytes"] for r in limited}
        sub = [p for p in gap_points if p[0] in lim_vols]
        v2 = validate(gap_params, sub)
        validation.update(mape_issue_drain_limited_pct=v2.mape_issue_pct,
                          mape_period_drain_limited_pct=v2.mape_period_pct, drain_limited_volumes=sorted(lim_vols))

    free = sweep.get("free_running") or []
    if free and math.isfinite(params.drain_rate_Bps):
        # Diagnostic only (not fitted, not in the MAPEs above): the same volume with free-running producers.
        fpts = [(r["volume_bytes"], max(r["gap_s"], 0.0), r["issue_s"], r["period_s"]) for r in free]
        max_law = validate(XStageParams(k, t0_fixed, issue_rate, params.drain_rate_Bps, math.inf), fpts)
        validation["free_running"] = {
            "volume_bytes": fpts[0][0], "num_points": len(fpts),
            "mape_issue_aligned_law_pct": validate(params, fpts).mape_issue_pct,
            "mape_issue_max_law_pct": max_law.mape_issue_pct,
            "mape_period_max_law_pct": max_law.mape_period_pct,
            "note": "free-running producers (only the first burst aligned) at one volume, predicted with the "
                    "aligned-burst law and with Q = inf; not used by the fit"}

    v_ref = max(r["volume_bytes"] for r in periodic if r["role"] != "plateau")
    summary = {
        "R_GBps": _finite_or_none(params.drain_rate_Bps / 1e9),
        "t_iss0_us": params.t_iss0(v_ref) * 1e6,
        "t_iss0_volume_bytes": v_ref,
        "Q_MiB": _finite_or_none(params.capacity_bytes / (1024 * 1024)),
        "mape_issue_pct": val.mape_issue_pct,
        "mape_period_pct": val.mape_period_pct,
        "mape_isolated_pct": mape_iso,
        "issue_err_over_period_pct": validation["mean_issue_err_over_period_pct"],
        "drain_limited": drain_limited,
    }
    if not drain_limited:
        summary["R_lower_bound_GBps"] = fit["R_lower_bound_Bps"] / 1e9
    return {"params": params, "fit": fit, "validation": validation, "drain_limited": drain_limited,
            "notes": notes, "summary": summary}


# ------------------------------------------------------------------------------------ machine & cache


def _driver_strings() -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:  # kernel module version, e.g. "580.159.03" (a cheap file read)
        text = Path("/proc/driver/nvidia/version").read_text()
        for tok in text.split():
            if tok.count(".") >= 1 and tok.replace(".", "").isdigit():
                out["driver"] = tok
                break
    except OSError:
        pass
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        if libcuda.cuDriverGetVersion(ctypes.byref(v)) == 0:
            out["cuda_driver_api"] = v.value
    except OSError:
        pass
    return out


def code_version() -> str:
    """Hash of what a calibration result depends on: the kernel source, the model and SWEEP_VERSION."""
    here = Path(__file__).resolve().parent
    h = hashlib.sha256(str(SWEEP_VERSION).encode())
    model = here.parent / "xstage"
    for p in (here / "csrc" / "burst.cu", model / "laws.py", model / "fits.py"):
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def machine_key(device: Any = None) -> dict[str, Any]:
    """What a calibration is valid for: GPU name, SM count, memory, compute capability, driver, the
    peer topology of the visible GPUs, and the code version. Raises CalibrationUnavailable without a GPU."""
    import torch

    if not torch.cuda.is_available():
        raise CalibrationUnavailable("calibration needs a CUDA GPU, found none (torch.cuda.is_available() is False); "
                                     "schedules fall back to XStageParams.reference() or the serial path")
    dev = _resolve_device(device)
    props = torch.cuda.get_device_properties(dev)
    n = torch.cuda.device_count()
    peers = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)] for i in range(n)]
    return {
        "gpu_name": props.name,
        "sm_count": props.multi_processor_count,
        "total_memory_bytes": props.total_memory,
        "compute_capability": f"{props.major}.{props.minor}",
        **_driver_strings(),
        "torch_cuda": torch.version.cuda,
        "device_count": n,
        "peer_access": peers,
        "code_version": code_version(),
    }


def _key_hash(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    env = os.environ.get("XSTAGE_DIT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "xstage_dit"


def cache_path(key: dict, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache file of a machine key: ``<cache_dir>/calibration-<hash of the key>.json``."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return root / f"calibration-{_key_hash(key)}.json"


def save_cache(result: CalibrationResult, cache_dir: str | os.PathLike | None = None) -> Path:
    """Write ``result`` to its machine key's cache file (atomically)."""
    path = cache_path(result.machine_key, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(result.to_json(), indent=1, default=float))
    os.replace(tmp, path)
    result.path = str(path)
    return path


def load_cache(key: dict, cache_dir: str | os.PathLike | None = None,
               targets: Sequence[str] = ()) -> CalibrationResult | None:
    """The cached result for ``key`` holding every target in ``targets``, or None (missing file, other
    machine key, older sweep version, missing target, unreadable file)."""
    path = cache_path(key, cache_dir)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("sweep_version") != SWEEP_VERSION or data.get("machine_key") != key:
        return None
    params = {t: XStageParams.from_dict(p) for t, p in data.get("params", {}).items()}
    if any(t not in params for t in targets):
        return None
    return CalibrationResult(params, key, "cache", data.get("targets", {}), quick=data.get("quick", True),
                             path=str(path))


# ------------------------------------------------------------------------------------------ measuring


def _resolve_device(device: Any):
    import torch

    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda":
        raise CalibrationUnavailable(f"expected a CUDA device to calibrate, got {dev}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.index >= torch.cuda.device_count():
        raise ValueError(f"expected a device index < {torch.cuda.device_count()}, got {dev.index}")
    return dev


def available_targets(device: Any = None, *, allow_shared_gpu: bool = False) -> list[str]:
    """Targets this machine can calibrate: local and host always (with a GPU); nvlink with a second GPU
    this one can reach with peer access (or two processes sharing one GPU when ``allow_shared_gpu``)."""
    import torch

    dev = _resolve_device(device)
    out = ["local", "host"]
    n = torch.cuda.device_count()
    if any(j != dev.index and torch.cuda.can_device_access_peer(dev.index, j) for j in range(n)) or allow_shared_gpu:
        out.append("nvlink")
    return out


def resolve_targets(target: str, device: Any = None, *, allow_shared_gpu: bool = False) -> list[str]:
    """The targets named by ``target`` ("auto", one name, or a comma-separated list), checked against
    this machine; an unavailable target is a CalibrationUnavailable naming it."""
    avail = available_targets(device, allow_shared_gpu=allow_shared_gpu)
    if target == "auto":
        return avail
    wanted = [t.strip() for t in target.split(",") if t.strip()]
    for t in wanted:
        _check_target(t)
        if t not in avail:
            import torch

            raise CalibrationUnavailable(
                f"target {t!r} is not available on this machine (available: {avail}); nvlink needs a second GPU "
                f"with peer access, found {torch.cuda.device_count()} GPU(s)")
    return wanted


def _periodic_point(target, *, kib: int, k: int, gap_s: float, plan: SweepPlan, clock_hz: float, threads: int,
                    gap_model, role: str, align_every_burst: bool = True) -> dict:
    """One gap-sweep point: the mean over producers and steady-state bursts of the measured issue time
    (start to stores accepted), gap (issue end to next start: the work, the loop's overhead, the wait at the
    per-burst alignment barrier and any stall that lands after the issue window) and period (= issue + gap).

    Every burst starts aligned (``align_every_burst``), the setting of the X-Stage laws. Free-running
    producers (run 3 on the H200) stagger after the first backed-up burst: long-gap bursts of 8.65 MB then
    issued in 1.27 us against 85 us for the same burst aligned, and near G = V/R the issue time depended on
    the stagger (18 us measured vs 1.2 us predicted), which R, T_iss0 and Q do not determine.

    The model's G is the measured gap, not the work's nominal time (``gap_work_s``): ``period - work``
    subtracts two large numbers at long gaps (0.5 % clock error = the whole plateau issue time), which
    made the T_iss0 fit fail on the H200 (benchmarks/results/calibration-h200-1gpu-run2-*)."""
    import numpy as np

    from xstage_dit.calibration.csrc.burst import run_bursts

    iters = gap_model.iters_for(gap_s)
    g_work = gap_model.gap_s(iters)
    runs = []
    for _ in range(plan.repeats):
        t = run_bursts(target, bytes_per_producer=kib * KIB, num_producers=k, num_bursts=plan.num_bursts,
                       gap_iters=iters, clock_hz=clock_hz, threads=threads, align_every_burst=align_every_burst)
        w = plan.warmup_bursts
        # issue_s[:, b] pairs with gap_s[:, b] (the gap after burst b); the burst gap is the slowest producer's
        # (from the last issue end to the next aligned start: the time the stage drains with no arrivals)
        runs.append((float(t.period_s[:, w:].mean()), float(t.issue_s[:, w:].mean()), float(t.gap_s[:, w:].mean()),
                     float(t.issue_s[:, w:].max()), float(t.gap_s[:, w:].min(axis=0).mean())))
    per, issue_meas, gap_meas, issue_max, gap_min = (float(np.median([r[i] for r in runs])) for i in range(5))
    return {"bytes_per_producer": kib * KIB, "volume_bytes": kib * KIB * k, "gap_request_s": gap_s,
            "gap_iters": iters, "gap_work_s": g_work, "gap_s": gap_meas, "issue_s": issue_meas, "period_s": per,
            "issue_max_s": issue_max, "burst_gap_s": gap_min, "aligned_every_burst": align_every_burst, "role": role}


def _isolated_point(target, *, kib: int, k: int, plan: SweepPlan, clock_hz: float, threads: int,
                    gap_model=None) -> dict:
    import numpy as np

    from xstage_dit.calibration.csrc.burst import run_bursts

    means, maxes = [], []
    for _ in range(plan.isolated_repeats):
        t = run_bursts(target, bytes_per_producer=kib * KIB, num_producers=k, num_bursts=1, gap_iters=0,
                       clock_hz=clock_hz, threads=threads)
        means.append(float(t.issue_s.mean()))
        maxes.append(float(t.issue_s.max()))
    return {"bytes_per_producer": kib * KIB, "volume_bytes": kib * KIB * k, "issue_s": float(np.median(means)),
            "issue_max_s": float(np.median(maxes))}


def sweep_target(target, *, plan: SweepPlan, num_producers: int, clock_hz: float, threads: int = 512,
                 gap_model=None) -> dict:
    """Run one target's sweeps (``target`` is a ``csrc.burst.BurstTarget``); returns the sweep dict of
    ``fit_sweep``. ``gap_model`` (``csrc.burst.GapModel``) converts gaps to work; None measures it."""
    k = num_producers
    need = plan.max_kib * KIB * k
    if need > target.nbytes:
        raise ValueError(f"expected the {target.name} buffer to hold {need} bytes (K={k} x {plan.max_kib} KiB), "
                         f"got {target.nbytes}")
    t_start = time.perf_counter()
    if gap_model is None:
        from xstage_dit.calibration.csrc.burst import measure_gap_model

        gap_model = measure_gap_model(target.device, k, clock_hz, threads)
    periodic: list[dict] = []
    zero_period: dict[int, float] = {}
    kw = dict(k=k, plan=plan, clock_hz=clock_hz, threads=threads, gap_model=gap_model)
    for kib in sorted(set(plan.gap_kib) | set(plan.isolated_kib)):
        z = _periodic_point(target, kib=kib, gap_s=0.0, role="zero", **kw)
        periodic.append(z)
        zero_period[kib] = z["period_s"]
        for f in plan.plateau_fractions:
            periodic.append(_periodic_point(target, kib=kib, gap_s=f * z["period_s"], role="plateau", **kw))
    for kib in plan.gap_kib:
        for f in plan.gap_fractions:
            if f == 0.0:
                continue  # the zero-gap point is already measured
            periodic.append(_periodic_point(target, kib=kib, gap_s=f * zero_period[kib], role="sweep", **kw))
    isolated = [_isolated_point(target, kib=kib, **kw) for kib in plan.isolated_kib]
    free_running = []
    if plan.free_running_kib is not None:
        kib = plan.free_running_kib
        z = _periodic_point(target, kib=kib, gap_s=0.0, role="free", align_every_burst=False, **kw)
        free_running.append(z)
        free_running += [_periodic_point(target, kib=kib, gap_s=f * z["period_s"], role="free", align_every_burst=False,
                                         **kw) for f in _QUICK_GAPS + (3.0,) if f > 0]
    return {"target": target.name, "num_producers": k, "threads": threads, "clock_hz": clock_hz,
            "aligned_every_burst": True,
            "gap_model": {"s_per_iter": gap_model.s_per_iter, "overhead_s": gap_model.overhead_s},
            "gap_kib": list(plan.gap_kib), "periodic": periodic, "isolated": isolated, "free_running": free_running,
            "sweep_s": time.perf_counter() - t_start}


def _warm_up(device) -> float:
    """Bring the SM clock up (the GPU idles at a few hundred MHz), then measure it."""
    from xstage_dit.calibration.csrc.burst import measure_sm_clock_hz

    for _ in range(5):
        measure_sm_clock_hz(device, spin_s=10e-3)
    return measure_sm_clock_hz(device, spin_s=2e-3)


def _make_target(name: str, nbytes: int, device):
    from xstage_dit.calibration.csrc.burst import host_target, local_target

    if name == "local":
        return local_target(nbytes, device)
    if name == "host":
        return host_target(nbytes, device)
    raise ValueError(f"expected a single-process target (local, host), got {name!r}")


def _measure_local_or_host(name: str, device, k: int, quick: bool, threads: int) -> dict:
    plan = plan_for(name, quick)
    target = _make_target(name, plan.max_kib * KIB * k, device)
    clock_hz = _warm_up(device)
    return sweep_target(target, plan=plan, num_producers=k, clock_hz=clock_hz, threads=threads)


def run_calibration(device: Any = None, config: CalibrationConfig | None = None) -> CalibrationResult:
    """Measure and fit every requested target now (no cache lookup); store nothing."""
    config = config or CalibrationConfig()
    key = machine_key(device)
    import torch

    dev = _resolve_device(device)
    torch.cuda.set_device(dev)
    targets = resolve_targets(config.target, dev, allow_shared_gpu=config.allow_shared_gpu)
    k = config.num_producers or torch.cuda.get_device_properties(dev).multi_processor_count
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    if k > sms:
        raise ValueError(f"expected num_producers <= {sms} (SMs on {torch.cuda.get_device_name(dev)}), got {k}")
    _ensure_built(dev)
    t0 = time.perf_counter()
    params, reports = {}, {}
    for name in targets:
        if name == "nvlink":
            from xstage_dit.calibration.peer import measure_peer

            sweep = measure_peer(dev, k=k, quick=config.quick, threads=config.threads,
                                 allow_shared_gpu=config.allow_shared_gpu)
        else:
            sweep = _measure_local_or_host(name, dev, k, config.quick, config.threads)
        rep = fit_sweep(sweep)
        params[name] = rep.pop("params")
        rep["sweep"] = sweep
        rep["params"] = params[name].to_dict()
        reports[name] = rep
        log.info("calibrated %s: %s", name, rep["summary"])
    return CalibrationResult(params, key, "measured", reports, time.perf_counter() - t0, quick=config.quick)


def _ensure_built(device) -> None:
    from xstage_dit.calibration.csrc.build import BuildError
    from xstage_dit.calibration.csrc.burst import library_for

    try:
        library_for(device)
    except BuildError as exc:
        raise CalibrationUnavailable(f"cannot build the burst kernel: {exc}") from exc


def load_or_calibrate(device: Any = None, *, quick: bool = True, target: str = "auto",
                      cache_dir: str | os.PathLike | None = None, force: bool = False,
                      allow_shared_gpu: bool = False) -> CalibrationResult:
    """The cached calibration of this machine, or a fresh one (then cached).

    device: CUDA device (None = current). quick: the start-up plan. target: "auto" | a target | a
    comma-separated list. Raises CalibrationUnavailable without a GPU (or nvcc, on a cache miss), and
    for a target this machine does not have.
    """
    config = CalibrationConfig(target=target, quick=quick, cache_dir=str(cache_dir) if cache_dir else None,
                               force=force, allow_shared_gpu=allow_shared_gpu)
    t0 = time.perf_counter()
    key = machine_key(device)
    targets = resolve_targets(target, device, allow_shared_gpu=allow_shared_gpu)
    if not force:
        cached = load_cache(key, cache_dir, targets)
        if cached is not None:
            cached.elapsed_s = time.perf_counter() - t0
            return cached
    result = run_calibration(device, config)
    save_cache(result, cache_dir)
    return result


def calibrate(device: Any = None, *, quick: bool = True, target: str = "auto",
              cache_dir: str | os.PathLike | None = None, force: bool = False) -> dict[str, XStageParams]:
    """Calibrated X-Stage params of this machine, keyed by target ("local", "host", "nvlink").

    Loads the cache when the machine key matches, else measures (quick: a few seconds) and caches.
    Example: ``xstage_dit.calibrate(target="host")["host"].drain_rate_Bps``.
    """
    return load_or_calibrate(device, quick=quick, target=target, cache_dir=cache_dir, force=force).params


def reference_result() -> CalibrationResult:
    """The published reference point for every target, where nothing can be measured."""
    p = XStageParams.reference()
    return CalibrationResult({t: p for t in TARGETS}, {}, "reference")

