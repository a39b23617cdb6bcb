"""Calibration logic without a GPU: fit + validation on synthetic sweeps, cache key and invalidation,
error messages, the CLI, the plots, and an nvcc compile of the CUDA sources (sm_90, compile only)."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xstage_dit.calibration.cache import cache_path, code_version, load_cache, machine_key, save_cache
from xstage_dit.calibration.fit import fit_sweep
from xstage_dit.calibration.result import CalibrationResult, reference_result
from xstage_dit.calibration.runner import CalibrationConfig, calibrate, load_or_calibrate
from xstage_dit.calibration.sweep import SWEEP_VERSION, SweepPlan, plan_for, sweep_target
from xstage_dit.calibration.targets import CalibrationUnavailable, TARGETS
from xstage_dit.xstage import KIB, MIB, XStageParams, isolated_issue_time, issue_time, period

ROOT = Path(__file__).resolve().parents[2]


def synthetic_sweep(p: XStageParams, *, noise: float, seed: int, overhead_s: float = 0.3e-6,
                    plan: SweepPlan | None = None, aligned: bool = True) -> dict:
    """What ``sweep_target`` would record on a stage that follows the laws exactly, plus noise. The
    loop's own overhead makes the measured gap slightly larger than the requested one. ``aligned=False``:
    an old free-running sweep, whose staggered long-gap bursts never back up (the max law, Q = inf)."""
    rng = random.Random(seed)
    plan = plan or plan_for("host", quick=False)
    k = p.num_producers
    periodic_law = p if aligned else XStageParams(k, p.t_iss0_fixed_s, p.issue_rate_Bps, p.drain_rate_Bps, math.inf)

    def n(x):
        return x * (1 + rng.gauss(0, noise))

    def point(kib, gap_req, role):
        v = kib * KIB * k
        g = gap_req + overhead_s
        iss = n(issue_time(periodic_law, v, g))
        return {"bytes_per_producer": kib * KIB, "volume_bytes": v, "gap_request_s": gap_req, "gap_s": g,
                "issue_s": iss, "period_s": iss + g, "role": role}

    periodic, zero = [], {}
    for kib in sorted(set(plan.gap_kib) | set(plan.isolated_kib)):
        z = point(kib, 0.0, "zero")
        periodic.append(z)
        zero[kib] = z["period_s"]
        periodic += [point(kib, f * z["period_s"], "plateau") for f in plan.plateau_fractions]
    for kib in plan.gap_kib:
        periodic += [point(kib, f * zero[kib], "sweep") for f in plan.gap_fractions if f > 0]
    isolated = [{"bytes_per_producer": kib * KIB, "volume_bytes": kib * KIB * k,
                 "issue_s": n(isolated_issue_time(p, kib * KIB * k))} for kib in plan.isolated_kib]
    sweep = {"target": "host", "num_producers": k, "threads": 512, "gap_kib": list(plan.gap_kib),
             "periodic": periodic, "isolated": isolated}
    if aligned:
        sweep["aligned_every_burst"] = True
    return sweep


PCIE_LIKE = XStageParams(132, 0.6e-6, 4.8e12, 55e9, 4.0e6)  # DESIGN §4's H200 host-pinned probe


@pytest.mark.parametrize("quick", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_sweep_recovers_a_drain_limited_target(quick, seed):
    plan = plan_for("host", quick=quick)
    rep = fit_sweep(synthetic_sweep(PCIE_LIKE, noise=0.02, seed=seed, plan=plan))
    p = rep["params"]
    assert rep["drain_limited"] is True
    assert p.drain_rate_Bps == pytest.approx(55e9, rel=0.05)
    assert p.capacity_bytes == pytest.approx(4.0e6, rel=0.05)
    v = 32 * KIB * 132
    assert p.t_iss0(v) == pytest.approx(PCIE_LIKE.t_iss0(v), rel=0.05)
    val = rep["validation"]
    assert val["mape_issue_pct"] <= 10 and val["mape_period_pct"] <= 10 and val["mape_isolated_pct"] <= 10
    s = rep["summary"]
    assert set(s) >= {"R_GBps", "t_iss0_us", "Q_MiB", "mape_issue_pct", "mape_period_pct", "drain_limited"}
    assert s["R_GBps"] == pytest.approx(55, rel=0.05) and s["Q_MiB"] == pytest.approx(4.0e6 / MIB, rel=0.05)


def test_fit_sweep_of_an_old_free_running_sweep():
    # run <= 3: only the first burst aligned; long-gap bursts staggered and never backed up, while isolated
    # bursts above the knee did. The gap sweep is predicted with Q = inf, the isolated one with Q, and a note says so.
    rep = fit_sweep(synthetic_sweep(PCIE_LIKE, noise=0.02, seed=0, aligned=False))
    p = rep["params"]
    assert rep["fit"]["aligned_every_burst"] is False
    assert p.drain_rate_Bps == pytest.approx(55e9, rel=0.05) and p.capacity_bytes == pytest.approx(4.0e6, rel=0.05)
    assert any("free-running" in n for n in rep["notes"])
    assert rep["validation"]["mape_issue_pct"] < 10 and rep["validation"]["mape_isolated_pct"] < 10
    # the same data read as aligned bursts would contradict the isolated sweep at long gaps
    sweep = synthetic_sweep(PCIE_LIKE, noise=0.02, seed=0, aligned=False)
    sweep["aligned_every_burst"] = True
    assert fit_sweep(sweep)["validation"]["mape_issue_pct"] > 20  # far outside the 10 % acceptance bound


def test_fit_sweep_says_so_when_the_target_never_backs_up():
    # local HBM: drains faster than K producers can issue; nothing to fit for R and Q
    hbm = XStageParams(132, 0.8e-6, 5e12, 20e12, math.inf)
    plan = plan_for("local", quick=False)
    rep = fit_sweep(synthetic_sweep(hbm, noise=0.02, seed=3, plan=plan))
    assert rep["drain_limited"] is False
    assert math.isinf(rep["params"].drain_rate_Bps) and math.isinf(rep["params"].capacity_bytes)
    assert rep["summary"]["R_GBps"] is None and rep["summary"]["Q_MiB"] is None
    assert rep["summary"]["R_lower_bound_GBps"] > 1000
    assert any("never drain-limited" in n for n in rep["notes"])
    # T_iss0 still predicts the whole sweep (period = T_iss0 + G everywhere)
    assert rep["validation"]["mape_period_pct"] < 5


def test_fit_sweep_reports_unobserved_capacity_as_a_note():
    p = XStageParams(132, 0.6e-6, 4.8e12, 55e9, 64 * MIB)  # knee far beyond the isolated sweep
    rep = fit_sweep(synthetic_sweep(p, noise=0.01, seed=4))
    assert rep["drain_limited"] and math.isinf(rep["params"].capacity_bytes)
    assert "Q_lower_bound_bytes" in rep["fit"] and any("no isolated burst backed up" in n for n in rep["notes"])


def test_fit_sweep_rejects_incomplete_sweeps():
    sweep = synthetic_sweep(PCIE_LIKE, noise=0.0, seed=0)
    with pytest.raises(ValueError, match="expected sweep key 'isolated'"):
        fit_sweep({k: v for k, v in sweep.items() if k != "isolated"})
    no_plateau = dict(sweep, periodic=[r for r in sweep["periodic"] if r["role"] != "plateau"])
    with pytest.raises(ValueError, match="plateau"):
        fit_sweep(no_plateau)


def _result(key: dict) -> CalibrationResult:
    rep = fit_sweep(synthetic_sweep(PCIE_LIKE, noise=0.01, seed=5))
    params = rep.pop("params")
    rep["params"] = params.to_dict()
    return CalibrationResult({"host": params}, key, "measured", {"host": rep}, 1.0)


KEY = {"gpu_name": "NVIDIA H200", "sm_count": 132, "driver": "580.159.03", "device_count": 1,
       "peer_access": [[True]], "code_version": "abc"}


def test_cache_roundtrip_and_invalidation(tmp_path):
    res = _result(KEY)
    path = save_cache(res, tmp_path)
    assert path == cache_path(KEY, tmp_path) and path.exists()
    t0 = time.perf_counter()
    got = load_cache(KEY, tmp_path, ["host"])
    load_s = time.perf_counter() - t0
    assert got is not None and got.source == "cache" and got.params == res.params
    assert load_s < 0.05, f"cache load took {load_s * 1e3:.1f} ms"
    # a changed machine (other driver, other GPU count, other code) maps to another file: recalibrate
    for change in ({"driver": "590.1"}, {"device_count": 2}, {"code_version": "def"}, {"sm_count": 78}):
        assert load_cache({**KEY, **change}, tmp_path, ["host"]) is None
    # a target not in the cache: recalibrate
    assert load_cache(KEY, tmp_path, ["host", "local"]) is None
    # an older sweep version or a key mismatch inside the file: recalibrate
    data = json.loads(path.read_text())
    path.write_text(json.dumps(dict(data, sweep_version=SWEEP_VERSION - 1)))
    assert load_cache(KEY, tmp_path, ["host"]) is None
    path.write_text(json.dumps(dict(data, machine_key={**KEY, "gpu_name": "other"})))
    assert load_cache(KEY, tmp_path, ["host"]) is None
    path.write_text("{not json")
    assert load_cache(KEY, tmp_path, ["host"]) is None


def test_code_version_tracks_the_kernel_source():
    v = code_version()
    assert len(v) == 16 and v == code_version()


def test_no_gpu_gives_a_clear_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for call in (lambda: load_or_calibrate(cache_dir=tmp_path), lambda: calibrate(cache_dir=tmp_path),
                 lambda: machine_key()):
        with pytest.raises(CalibrationUnavailable, match="needs a CUDA GPU, found none"):
            call()
    assert issubclass(CalibrationUnavailable, RuntimeError)
    assert not list(tmp_path.iterdir())


def test_config_and_plan_validation():
    with pytest.raises(ValueError, match="expected a target in"):
        CalibrationConfig(target="pcie")
    with pytest.raises(ValueError, match="num_producers >= 1"):
        CalibrationConfig(num_producers=0)
    with pytest.raises(ValueError, match="threads"):
        CalibrationConfig(threads=100)
    CalibrationConfig(target="local,host")
    with pytest.raises(ValueError, match="gap_kib"):
        SweepPlan((), (0.0,), (2.0,), (8,))
    with pytest.raises(ValueError, match="plateau_fractions"):
        SweepPlan((8,), (0.0,), (1.0,), (8,))
    with pytest.raises(ValueError, match="expected a target"):
        plan_for("nvme", quick=True)


def test_reference_result():
    res = reference_result()
    assert res.source == "reference" and set(res.params) == set(TARGETS)
    assert res.params["nvlink"].drain_rate_Bps == pytest.approx(717e9)


def _cli(capsys, *args) -> tuple[int, str]:
    from xstage_dit.cli import main

    try:
        code = main(["calibrate", *args])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_cli_errors_are_one_line(capsys):
    code, err = _cli(capsys, "--target", "pcie")
    assert code == 2 and "expected a target in" in err and "pcie" in err
    code, err = _cli(capsys, "--producers", "0")
    assert code == 2 and "num_producers >= 1" in err
    import torch

    if not torch.cuda.is_available():
        code, err = _cli(capsys, "--target", "host")
        assert code == 2 and err.count("\n") == 1 and "needs a CUDA GPU, found none" in err


def test_table_and_plots(tmp_path):
    from xstage_dit.cli.calibrate import PLOTS, draw_plots, format_table

    res = _result(KEY)
    res.reports["host"]["sweep"] = synthetic_sweep(PCIE_LIKE, noise=0.01, seed=5)
    table = format_table(res)
    assert "host" in table and "yes" in table
    paths = draw_plots(res, tmp_path, "calibration-test")
    assert [p.name for p in paths] == [f"calibration-test-{p}.png" for p in PLOTS]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


# --------------------------------------------------------------------------------- CUDA sources (CI)

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources not compiled")
def test_cuda_sources_compile_for_sm90(tmp_path):
    sources = sorted((ROOT / "xstage_dit" / "calibration" / "csrc").glob("*.cu"))
    assert sources
    for src in sources:
        proc = subprocess.run([NVCC, "-arch=sm_90", "-c", str(src), "-o", str(tmp_path / (src.stem + ".o"))],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        ptx = subprocess.run([NVCC, "-arch=sm_90", "-ptx", str(src), "-o", "-"], capture_output=True, text=True,
                             timeout=300).stdout
        if src.name == "burst.cu":
            assert "st.global.v4" in ptx  # 16-byte stores
            assert "%globaltimer" in ptx and "%clock64" in ptx


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources not compiled")
def test_build_is_cached_and_can_be_refused(tmp_path, monkeypatch):
    from xstage_dit.calibration.csrc import build

    monkeypatch.setenv("XSTAGE_DIT_CACHE", str(tmp_path))
    lib = build.build_library("xstage_burst", ["burst.cu"], (9, 0))
    assert lib.exists() and lib.parent.parent == tmp_path / "build"
    mtime = lib.stat().st_mtime_ns
    t0 = time.perf_counter()
    assert build.build_library("xstage_burst", ["burst.cu"], (9, 0)) == lib  # cached: no compile
    assert time.perf_counter() - t0 < 0.5 and lib.stat().st_mtime_ns == mtime
    monkeypatch.setenv("XSTAGE_DIT_NO_BUILD", "1")
    with pytest.raises(build.BuildError, match="XSTAGE_DIT_NO_BUILD=1"):
        build.build_library("xstage_burst", ["burst.cu"], (8, 0))  # another arch: another key
    with pytest.raises(build.BuildError, match="compute capability >= 7.0"):
        build.arch_flag((6, 1))
    with pytest.raises(build.BuildError, match="expected CUDA sources"):
        build.build_library("x", ["missing.cu"], (9, 0))


def test_sweep_target_end_to_end_on_a_simulated_stage(monkeypatch):
    """sweep_target -> fit_sweep with the kernel replaced by a stage that follows the laws (plus noise):
    checks the sweep's bookkeeping (roles, volumes, warm-up bursts dropped, gaps from zero-gap periods)."""
    import numpy as np

    from xstage_dit.calibration.csrc import burst

    truth = PCIE_LIKE
    rng = np.random.default_rng(0)
    calls = []

    gap_model = burst.GapModel(s_per_iter=32e-9, overhead_s=0.2e-6)

    def fake_run_bursts(target, *, bytes_per_producer, num_producers, num_bursts, gap_iters, clock_hz, threads=512,
                        tag=0, align_every_burst=False):
        v = bytes_per_producer * num_producers
        calls.append((bytes_per_producer, num_bursts, gap_iters))
        assert align_every_burst or num_bursts == 1  # periodic bursts are the laws' aligned bursts
        g = gap_model.gap_s(gap_iters)
        if num_bursts == 1:
            iss = np.full((num_producers, 1), isolated_issue_time(truth, v))
        else:
            iss = np.full((num_producers, num_bursts), issue_time(truth, v, g))
            iss[:, :2] *= 3.0  # a cold start the warm-up drop must hide
        iss = iss * (1 + 0.01 * rng.standard_normal(iss.shape))
        gaps = np.full((num_producers, num_bursts - 1), g)
        return burst.BurstTiming(bytes_per_producer, num_producers, num_bursts, gap_iters, iss, gaps,
                                 iss[:, :-1] + gaps, np.arange(num_producers), clock_hz, 0.0)

    monkeypatch.setattr(burst, "run_bursts", fake_run_bursts)
    plan = plan_for("host", quick=True)
    target = burst.BurstTarget("host", 0, plan.max_kib * KIB * 132, None)
    sweep = sweep_target(target, plan=plan, num_producers=132, clock_hz=1.98e9, gap_model=gap_model)
    assert sweep["aligned_every_burst"] is True and all(r["aligned_every_burst"] for r in sweep["periodic"])
    roles = [r["role"] for r in sweep["periodic"]]
    vols = set(plan.gap_kib) | set(plan.isolated_kib)
    assert roles.count("zero") == len(vols) and roles.count("plateau") == len(vols) * len(plan.plateau_fractions)
    assert roles.count("sweep") == len(plan.gap_kib) * (len(plan.gap_fractions) - 1)
    assert len(sweep["isolated"]) == len(plan.isolated_kib)
    assert sweep["free_running"] == []  # the quick plan skips the free-running comparison
    rep = fit_sweep(sweep)
    assert rep["drain_limited"]
    assert rep["params"].drain_rate_Bps == pytest.approx(truth.drain_rate_Bps, rel=0.03)
    assert rep["params"].capacity_bytes == pytest.approx(truth.capacity_bytes, rel=0.05)
    assert rep["validation"]["mape_period_pct"] < 3
    # gaps are whole FMA iterations; G is the measured gap, issue the measured issue (cold bursts dropped)
    for r in sweep["periodic"]:
        assert r["gap_work_s"] == pytest.approx(gap_model.gap_s(r["gap_iters"]))
        assert r["gap_s"] == pytest.approx(r["gap_work_s"])  # the simulated stage stalls only in the issue window
        assert r["period_s"] == pytest.approx(r["issue_s"] + r["gap_s"], rel=0.02)
    # the full plan adds one free-running volume, reported beside the fit and launched without per-burst alignment
    full = plan_for("host", quick=False)
    calls.clear()
    aligned_flags = []
    real_fake = fake_run_bursts

    def spy(*a, **kw):
        aligned_flags.append((kw["num_bursts"], kw.get("align_every_burst", False), kw["bytes_per_producer"]))
        kw["align_every_burst"] = True  # the simulated stage is the aligned law either way
        return real_fake(*a, **kw)

    monkeypatch.setattr(burst, "run_bursts", spy)
    target = burst.BurstTarget("host", 0, full.max_kib * KIB * 132, None)
    sweep = sweep_target(target, plan=full, num_producers=132, clock_hz=1.98e9, gap_model=gap_model)
    assert {r["role"] for r in sweep["free_running"]} == {"free"}
    assert all(r["bytes_per_producer"] == full.free_running_kib * KIB for r in sweep["free_running"])
    free_launches = [f for f in aligned_flags if f[0] > 1 and not f[1]]
    assert free_launches and all(f[2] == full.free_running_kib * KIB for f in free_launches)
    rep = fit_sweep(sweep)
    fr = rep["validation"]["free_running"]
    assert fr["num_points"] == len(sweep["free_running"]) and fr["mape_issue_aligned_law_pct"] < 10
    assert rep["summary"]["mape_issue_pct"] < 10 and rep["summary"]["mape_isolated_pct"] < 10
    assert burst.GapModel(1e-8, 1e-7).iters_for(1.1e-6) == 100
    assert burst.GapModel(1e-8, 1e-7).iters_for(0.0) == 0
    with pytest.raises(ValueError, match="expected the host buffer to hold"):
        sweep_target(burst.BurstTarget("host", 0, 1024, None), plan=plan, num_producers=132, clock_hz=1e9,
                         gap_model=gap_model)
