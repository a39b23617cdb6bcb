"""The batch-or-FIFO decision: batch compatible requests only where a batch pays, and only where a batched
image is the one its seed alone gives.

A batch of n items at one size makes every one of its users wait for all n images, so it must buy
throughput: `decide` batches a size only when a measured batch raised images per second by at least
``margin`` (default 10 %) over one image at a time, AND every image of the measured batch was bit-identical
to the same seed run alone (batched matmuls may pick other kernels, which round differently: the README's
promise would break). Everywhere else requests run first come, first served, one pipeline call per image,
so no request waits for another's work. Sizes never measured run FIFO (``unmeasured``).

The measurement (`Probe`) is made at warm-up, per warm-up size, by the worker: two steps of one image, then
two steps of a batch of ``max_batch_size``, both timed per step with CUDA events (the second step, so
prompt encoding and latent set-up do not count), the images compared byte for byte.

Policies: ``auto`` (the rule above), ``always`` (batch every compatible request: the old behaviour, for a
comparison), ``never`` (FIFO everywhere).

Example::

    batcher = Batcher("auto", max_batch_size=4, margin=0.10)
    batcher.record(Probe((1024, 1024, 1), n=4, single_step_s=0.176, batch_step_s=0.70, identical=True))
    batcher.limit((1024, 1024, 1))    # 1: a batch of 4 is 1.006x, not >= 1.10x: FIFO
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

POLICIES = ("auto", "always", "never")
DEFAULT_MARGIN = 0.10
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Probe:
    """One measurement at a size: (width, height, frames), n items per batch, seconds per step of one image
    and of the batch of n, and whether every batched image equalled its single run byte for byte."""

    size: tuple
    n: int
    single_step_s: float
    batch_step_s: float
    identical: bool

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 2:
            raise ValueError(f"expected a probe batch of n >= 2 items, got {self.n!r}")
        for name in ("single_step_s", "batch_step_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"expected {name} > 0 seconds, got {value!r}")

    @property
    def speedup(self) -> float:
        """Images per second of the batch over one image at a time: n * t_single / t_batch."""
        return self.n * self.single_step_s / self.batch_step_s


@dataclass(frozen=True)
class Decision:
    batch: bool
    reason: str
    speedup: float | None = None


def decide(probe: Probe, margin: float = DEFAULT_MARGIN) -> Decision:
    """Batch at probe.size only if the batch's images are bit-identical to single runs and its speedup is
    at least 1 + margin."""
    if not probe.identical:
        return Decision(False, f"batched images differ from single ones at {_label(probe.size)}", probe.speedup)
    if probe.speedup < 1.0 + margin:
        return Decision(False, f"a batch of {probe.n} is {probe.speedup:.3f}x images/s, below the {1 + margin:.2f}x "
                               f"margin", probe.speedup)
    return Decision(True, f"a batch of {probe.n} is {probe.speedup:.3f}x images/s (>= {1 + margin:.2f}x) and "
                          "bit-identical", probe.speedup)


def _label(size: tuple) -> str:
    width, height, frames = size
    return f"{width}x{height}" + (f"x{frames}" if frames != 1 else "")


def size_of(batch_key: tuple) -> tuple:
    """(width, height, frames) of a `GenerationRequest.batch_key`."""
    return batch_key[1], batch_key[2], batch_key[5]


class Batcher:
    """The decisions of one server; thread-safe. `limit(batch_key)`: items one batch of that key may hold."""

    def __init__(self, policy: str = "auto", max_batch_size: int = 4, margin: float = DEFAULT_MARGIN,
                 metrics: Any = None):
        if policy not in POLICIES:
            raise ValueError(f"expected a batching policy in {', '.join(POLICIES)}, got {policy!r}")
        if not (math.isfinite(margin) and margin >= 0):
            raise ValueError(f"expected a batching margin >= 0, got {margin!r}")
        self.policy = policy
        self.max_batch_size = max_batch_size
        self.margin = margin
        self.metrics = metrics
        self._decisions: dict[tuple, Decision] = {}
        self._lock = threading.Lock()
        self.alone: str | None = None  # why every request runs alone, whatever the policy (`run_alone`)

    def run_alone(self, reason: str) -> None:
        """Every request runs in its own pipeline call from now on, whatever the policy (a step cache: its state
        and decisions are one request's), with `reason` in the decisions and the report."""
        self.alone = reason

    @property
    def wants_probe(self) -> bool:
        return self.policy == "auto" and self.max_batch_size > 1 and self.alone is None

    def record(self, probe: Probe) -> Decision:
        decision = decide(probe, self.margin)
        with self._lock:
            self._decisions[tuple(probe.size)] = decision
        if self.metrics is not None:
            self.metrics.batch_speedup.labels(_label(probe.size)).set(probe.speedup)
            self.metrics.batch_identical.labels(_label(probe.size)).set(int(probe.identical))
        return decision

    def decision(self, batch_key: tuple) -> Decision:
        if self.alone is not None:
            return Decision(False, self.alone)
        if self.policy == "always":
            return Decision(True, "batching policy 'always'")
        if self.policy == "never" or self.max_batch_size == 1:
            return Decision(False, "batching off (policy 'never' or max batch size 1)")
        with self._lock:
            found = self._decisions.get(size_of(batch_key))
        return found or Decision(False, f"{_label(size_of(batch_key))} not measured at warm-up")

    def limit(self, batch_key: tuple) -> int:
        return self.max_batch_size if self.decision(batch_key).batch else 1

    def report(self) -> dict:
        """The decisions so far, per size label (shown in the start-up report)."""
        with self._lock:
            items = list(self._decisions.items())
        return {"policy": self.policy, "margin": self.margin, "max_batch_size": self.max_batch_size,
                **({"alone": self.alone} if self.alone is not None else {}),
                "sizes": {_label(s): {"batch": d.batch, "reason": d.reason, "speedup": d.speedup} for s, d in items}}

    def probe(self, runner: Any, item: Any, single: Any, n: int) -> None:
        """Measure a batch of `n` at `item`'s size on `runner` (the worker's `BatchRunner`) against `single` (its
        one-image run) and record the decision. A batch that fails (out of memory, ...) leaves that size FIFO."""
        never = lambda *_: True  # noqa: E731
        width, height = item.width, item.height
        started = time.perf_counter()
        try:
            batch = runner.warmup(replace(item, n=n), never)  # with LoRA slots: their batched graphs too
            alone = [single.pixels[0]] + [runner.run([replace(item, seed=i)], never).pixels[0] for i in range(1, n)]
        except Exception as exc:  # noqa: BLE001 - the size stays unmeasured, so FIFO
            log.warning("batching %dx%d: the probe batch of %d failed (%s): FIFO", width, height, n,
                        str(exc).splitlines()[0][:200])
            return
        identical = all(np.array_equal(b, a) for b, a in zip(batch.pixels, alone))
        probe = Probe((width, height, item.num_frames), n, min(single.step_times), min(batch.step_times), identical)
        decision = self.record(probe)
        log.info("batching %dx%d: %s -> %s (probe %.2f s)", width, height, decision.reason,
                 "batch" if decision.batch else "FIFO", time.perf_counter() - started)
