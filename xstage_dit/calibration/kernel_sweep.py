"""Which attention kernel is fastest per shape family on this machine: timed once, cached beside the calibration.

The sweep times, for every shape family the server will run, each kernel that takes it (FA4, cuDNN through
cudnn-frontend, our Triton kernel; all writing through a peer window) and keeps the medians:

    sweep = load_or_sweep(key, make_cases, time_fn)          # KernelSweep(key, timings_ms, source, path)
    sweep.timings_ms["bf16-d128-b1-s4096-hr3-p8"]            # {"fa4": 0.158, "cudnn": 0.106, "triton": 0.118}

What a result is valid for (``sweep_key``): the GPU, driver and the versions of every library whose kernels
it times (torch, triton, cuDNN, flash-attn-4, cudnn-frontend) and this module's ``SWEEP_VERSION``; another key
reads as a miss and the sweep runs again. Families are opaque strings here (``schedule.attention_kernel``
names them); the timing closures come from the caller (``ops.attention.window_path.sweep_cases``), so this
module measures without importing the ops (layer 2).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from xstage_dit.calibration.cache import _driver_strings, _key_hash, default_cache_dir

log = logging.getLogger(__name__)

# 2: world-1 families time torch SDPA ("sdpa", diffusers' call) against FA4 plain; world > 1 families add
# "sdpa" (the serial schedule's local attention) as the reference of each kernel's speed. 3: world-1 families
# also time torch's cuDNN SDPA backend ("cudnn"). 4: world > 1 families also time fa4-gqa. 5: and
# fa4-gqa-unpacked. 6: "-fp8" families also time the 8-bit kernels (cudnn-fp8, sage), and the key names the
# sageattention version. 7: world-1 "-fp8" families also time cudnn-fp8 compiled ("cudnn-fp8+compiled"), and every
# time is GPU time with the calls' launch cost hidden (`cuda_event_ms`). 8: and cudnn-fp8 and torch SDPA each
# compiled inside a block's elementwise kernels ("+in-block", `attention_kernel.as_compiled`).
SWEEP_VERSION = 8


def sweep_key(gpu_name: str, versions: dict[str, Any]) -> dict[str, Any]:
    """The key a kernel sweep is valid for: GPU, driver, library versions, sweep version."""
    return {"gpu_name": gpu_name, **_driver_strings(), "versions": dict(sorted(versions.items())),
            "sweep_version": SWEEP_VERSION}


def cache_path(key: dict, cache_dir: str | os.PathLike | None = None) -> Path:
    """``<cache_dir>/kernel-sweep-<hash of the key>.json`` (the calibration's cache directory)."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return root / f"kernel-sweep-{_key_hash(key)}.json"


@dataclass
class KernelSweep:
    """timings_ms: {family: {kernel: median ms, or None where it failed}}; source: "measured" | "cache";
    errors: {family: {kernel: message}}."""

    key: dict
    timings_ms: dict[str, dict[str, float | None]]
    source: str
    errors: dict[str, dict[str, str]] = field(default_factory=dict)
    path: str | None = None

    def to_json(self) -> dict:
        return {"key": self.key, "timings_ms": self.timings_ms, "errors": self.errors}


def run_sweep(cases: dict[str, dict[str, Callable[[], Any]]], time_fn: Callable[[Callable[[], Any]], float],
              rounds: int = 3) -> tuple[dict, dict]:
    """Time every (family, kernel) closure ``rounds`` times, kernels of one family interleaved (a drift of the
    GPU does not read as a kernel difference). Returns (timings_ms, errors); a kernel that raises is None."""
    timings: dict[str, dict[str, float | None]] = {}
    errors: dict[str, dict[str, str]] = {}
    for family, fns in cases.items():
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for r in range(rounds):
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                if name in errors.get(family, {}):
                    continue
                try:
                    samples[name].append(float(time_fn(fns[name])))
                except Exception as exc:  # noqa: BLE001 - a kernel failing on a shape is a result of the sweep
                    errors.setdefault(family, {})[name] = f"{type(exc).__name__}: {exc}"[:300]
        timings[family] = {name: (statistics.median(s) if s and name not in errors.get(family, {}) else None)
                           for name, s in samples.items()}
        log.info("kernel sweep %s: %s", family, timings[family])
    return timings, errors


def one_call_ms(fn: Callable[[], Any], *, warmups: int = 1) -> float:
    """Milliseconds of one call of ``fn`` between two CUDA events, after ``warmups`` untimed calls (the first
    call compiles: FA4's first call of a shape takes seconds). A rough figure, for choosing how many calls a
    measurement needs to fill its target time; at least 1 µs, so callers can divide by it."""
    import torch

    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return max(start.elapsed_time(end), 1e-3)


# torch.cuda._sleep counts SM clock cycles: converted at a clock above any GPU's here (an H100's or H200's boost is
# 1.98 GHz), so the sleep lasts at least as long as asked; a longer one costs wall time, never the measurement.
_SLEEP_HZ = 2.5e9


def cuda_event_ms(fn: Callable[[], Any], *, target_ms: float = 20.0, min_reps: int = 3, max_reps: int = 50) -> float:
    """Milliseconds of GPU time per call of ``fn`` on the current CUDA stream: one untimed call first, then enough
    back-to-back calls between two CUDA events to fill about ``target_ms``, queued behind a GPU sleep long enough
    for the CPU to launch them all. So a call's Python and launch cost is hidden, as it is inside a model step the
    GPU is the bottleneck of (a 100 ms transformer step: the CPU runs blocks ahead); timed back to back, a kernel
    with a few hundred microseconds of host work per call would be judged by that instead of its GPU time. The
    time function the sweep uses on a GPU."""
    import time

    import torch

    reps = int(min(max_reps, max(min_reps, math.ceil(target_ms / one_call_ms(fn)))))
    t0 = time.perf_counter()
    fn()  # how long one call takes to launch (the GPU may still be running it)
    launch_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    torch.cuda._sleep(int(min(2.0, 2 * reps * launch_s + 0.002) * _SLEEP_HZ))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def save(sweep: KernelSweep, cache_dir: str | os.PathLike | None = None) -> Path:
    path = cache_path(sweep.key, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(sweep.to_json(), indent=1))
    os.replace(tmp, path)
    sweep.path = str(path)
    return path


def load(key: dict, cache_dir: str | os.PathLike | None = None) -> KernelSweep | None:
    """The cached sweep for ``key``, or None (missing, unreadable, or another key)."""
    path = cache_path(key, cache_dir)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("key") != key:
        return None
    timings = {f: {k: (None if v is None or not math.isfinite(v) else float(v)) for k, v in t.items()}
               for f, t in data.get("timings_ms", {}).items()}
    return KernelSweep(key, timings, "cache", data.get("errors", {}), str(path))


def load_or_sweep(key: dict, make_cases: Callable[[list[str]], dict], families: list[str],
                  time_fn: Callable[[Callable[[], Any]], float], *, cache_dir: str | os.PathLike | None = None,
                  force: bool = False, rounds: int = 3) -> KernelSweep:
    """The cached sweep when it holds every family in ``families``; else time the missing families
    (``make_cases(missing) -> {family: {kernel: fn}}``), merge, save and return it."""
    cached = None if force else load(key, cache_dir)
    missing = [f for f in families if cached is None or f not in cached.timings_ms]
    if cached is not None and not missing:
        return cached
    timings, errors = run_sweep(make_cases(missing), time_fn, rounds=rounds)
    merged = KernelSweep(key, {**(cached.timings_ms if cached else {}), **timings}, "measured",
                         {**(cached.errors if cached else {}), **errors})
    save(merged, cache_dir)
    return merged
