"""Startup calibration: measure remote-store issue, drain and capacity on this machine, fit the X-Stage
model (``xstage_dit.xstage``), validate the fit, cache it per machine.

One module per concern: `targets` (names, availability), `sweep` (the plan and the measurement), `fit`
(the fit of a sweep), `result`, `cache` (machine key, cache file), `peer` (the nvlink target's two
processes), and here the entry points. Serving code asks `provider.params_for`, never these.

Public API::

    result = load_or_calibrate()          # cache hit: a file read; miss: measure (quick) and store
    result.params["host"].drain_rate_Bps
    params = xstage_dit.calibrate(target="host", quick=False)   # dict[target, XStageParams]
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from xstage_dit.calibration.cache import load_cache, machine_key, save_cache
from xstage_dit.calibration.fit import fit_sweep
from xstage_dit.calibration.peer import measure_peer
from xstage_dit.calibration.result import CalibrationResult
from xstage_dit.calibration.sweep import measure_local_or_host
from xstage_dit.calibration.targets import CalibrationUnavailable, check_target, resolve_device, resolve_targets
from xstage_dit.xstage import XStageParams

log = logging.getLogger(__name__)

__all__ = ["CalibrationConfig", "run_calibration", "load_or_calibrate", "calibrate"]


@dataclass(frozen=True)
class CalibrationConfig:
    """How ``load_or_calibrate`` / ``calibrate`` run.

    target: "auto" (every target this machine has: local, host, and nvlink with >= 2 peer GPUs), one
    of ``TARGETS``, or a comma-separated list. quick: the start-up plan (seconds) instead of the full
    one. num_producers: K (None = one per SM). threads: per producer. allow_shared_gpu: let the nvlink
    target run with two processes sharing one GPU (tests). Where results are cached, and whether a cache
    hit is taken, are arguments of ``load_or_calibrate``: ``run_calibration`` never reads the cache.
    """

    target: str = "auto"
    quick: bool = True
    num_producers: int | None = None
    threads: int = 512
    allow_shared_gpu: bool = False

    def __post_init__(self) -> None:
        if self.target != "auto":
            for t in self.target.split(","):
                check_target(t.strip())
        if self.num_producers is not None and (not isinstance(self.num_producers, int) or self.num_producers < 1):
            raise ValueError(f"expected num_producers >= 1 (or None for one per SM), got {self.num_producers!r}")
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"expected threads a multiple of 32 in [32, 1024], got {self.threads}")



def run_calibration(device: Any = None, config: CalibrationConfig | None = None) -> CalibrationResult:
    """Measure and fit every requested target now (no cache lookup); store nothing."""
    config = config or CalibrationConfig()
    key = machine_key(device)
    import torch

    dev = resolve_device(device)
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
            sweep = measure_peer(dev, k=k, quick=config.quick, threads=config.threads,
                                 allow_shared_gpu=config.allow_shared_gpu)
        else:
            sweep = measure_local_or_host(name, dev, k, config.quick, config.threads)
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
    config = CalibrationConfig(target=target, quick=quick, allow_shared_gpu=allow_shared_gpu)
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

