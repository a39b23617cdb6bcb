"""What one target's calibration measures (``SweepPlan``) and the measurement itself (``sweep_target``).

Per target the burst kernel (``csrc/burst.cu``) runs three sweeps with ``K`` producers (one per SM):

- periodic bursts at every gap-sweep volume: zero gap (role "zero": ``T_period = V/R`` where the drain
  limits), gaps as fractions of that zero-gap period (role "sweep"), and long gaps (role "plateau":
  ``T_iss0``); plateau and zero-gap points are also taken at every isolated-sweep volume;
- isolated bursts (one burst per launch, so the stage starts drained) over volumes around the knee.

The result is the sweep dict that `fit.fit_sweep` fits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from xstage_dit.calibration.targets import check_target
from xstage_dit.xstage import KIB

# Bump when the sweep or the fit changes meaning: cached results of another version are recalibrated.
# 2: every periodic burst starts aligned across producers (1: only the first; the rest free-ran).
SWEEP_VERSION = 2

__all__ = ["SWEEP_VERSION", "SweepPlan", "PLANS", "plan_for", "sweep_target", "warm_up", "make_target",
           "measure_local_or_host"]


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
# Remote targets: the isolated sweep is dense around the knee measured on the reference system and on the GPU
# over PCIe (DESIGN §4).
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
    """The plan of ``target`` (local HBM has its own; host and nvlink share the remote one)."""
    check_target(target)
    return PLANS[("local" if target == "local" else "remote", bool(quick))]



def _periodic_point(target, *, kib: int, k: int, gap_s: float, plan: SweepPlan, clock_hz: float, threads: int,
                    gap_model, role: str, align_every_burst: bool = True) -> dict:
    """One gap-sweep point: the mean over producers and steady-state bursts of the measured issue time
    (start to stores accepted), gap (issue end to next start: the work, the loop's overhead, the wait at the
    per-burst alignment barrier and any stall that lands after the issue window) and period (= issue + gap).

    Every burst starts aligned (``align_every_burst``), the setting of the X-Stage laws. Free-running producers
    stagger after the first backed-up burst: their long-gap bursts then issue far faster than the same burst
    aligned, and near G = V/R the issue time depends on the stagger, which R, T_iss0 and Q do not determine
    (calibration runs 1-3: benchmarks/results/figures-from-code.md; their files in git history,
    benchmarks/results/README.md).

    The model's G is the measured gap, not the work's nominal time (``gap_work_s``): ``period - work``
    subtracts two large numbers at long gaps (a clock error of a fraction of a percent is the whole plateau
    issue time), which made the T_iss0 fit of calibration run 2 fail (benchmarks/results/README.md)."""
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


def _isolated_point(target, *, kib: int, k: int, plan: SweepPlan, clock_hz: float, threads: int) -> dict:
    """One isolated burst volume: the median over launches of the mean (and max) issue time over producers."""
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
    ``fit.fit_sweep``. ``gap_model`` (``csrc.burst.GapModel``) converts gaps to work; None measures it."""
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
    isolated = [_isolated_point(target, kib=kib, k=k, plan=plan, clock_hz=clock_hz, threads=threads)
                for kib in plan.isolated_kib]
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


def warm_up(device) -> float:
    """Bring the SM clock up (the GPU idles at a few hundred MHz), then measure it."""
    from xstage_dit.calibration.csrc.burst import measure_sm_clock_hz

    for _ in range(5):
        measure_sm_clock_hz(device, spin_s=10e-3)
    return measure_sm_clock_hz(device, spin_s=2e-3)


def make_target(name: str, nbytes: int, device):
    """A ``csrc.burst.BurstTarget`` of ``nbytes`` for a single-process target ("local" or "host")."""
    from xstage_dit.calibration.csrc.burst import host_target, local_target

    if name == "local":
        return local_target(nbytes, device)
    if name == "host":
        return host_target(nbytes, device)
    raise ValueError(f"expected a single-process target (local, host), got {name!r}")


def measure_local_or_host(name: str, device, k: int, quick: bool, threads: int) -> dict:
    """The sweep of a single-process target ("local" or "host") on ``device`` with ``k`` producers."""
    plan = plan_for(name, quick)
    target = make_target(name, plan.max_kib * KIB * k, device)
    clock_hz = warm_up(device)
    return sweep_target(target, plan=plan, num_producers=k, clock_hz=clock_hz, threads=threads)

