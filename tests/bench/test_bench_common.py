"""benchmarks/_common.py helpers that need no GPU: interleaved timing rounds."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import interleaved_times  # noqa: E402


def test_interleaved_rounds_cancel_a_linear_drift():
    calls, clock = [], [0]

    def drifting_timer(fn):
        # Every timing comes out 0.1 ms faster than the one before it (a GPU warming up); all variants equal.
        clock[0] += 1
        calls.append(fn())
        return 10.0 - 0.1 * clock[0]

    fns = {name: (lambda n=name: n) for name in ("cudnn", "local", "fused_2", "fused_4")}
    times = interleaved_times(fns, drifting_timer, rounds=4)
    assert calls[:8] == ["cudnn", "local", "fused_2", "fused_4", "fused_4", "fused_2", "local", "cudnn"]
    assert all(len(t) == 4 for t in times.values())
    medians = {name: statistics.median(t) for name, t in times.items()}
    assert max(medians.values()) - min(medians.values()) == pytest.approx(0.0, abs=1e-9)
    # Timed one after the other, the same drift reads as a 0.3 ms "difference" between the first and last.
    sequential = {name: 10.0 - 0.1 * (i + 1) for i, name in enumerate(fns)}
    assert sequential["cudnn"] - sequential["fused_4"] == pytest.approx(0.3)


def test_interleaved_rounds_validate():
    with pytest.raises(ValueError, match="rounds >= 1"):
        interleaved_times({"a": lambda: None}, lambda fn: 1.0, rounds=0)


def test_a_failing_variant_is_dropped_and_named_while_the_others_are_timed():
    def timer(fn):
        return fn()

    def broken():
        raise RuntimeError("capture failed")

    fns = {"cudnn": lambda: 1.0, "fa4": lambda: 0.9, "cudnnfe": broken}
    errors: dict = {}
    times = interleaved_times(fns, timer, rounds=3, errors=errors, required=("cudnn",))
    assert set(times) == {"cudnn", "fa4"} and all(len(t) == 3 for t in times.values())
    assert set(errors) == {"cudnnfe"} and "capture failed" in errors["cudnnfe"]
    with pytest.raises(RuntimeError, match="capture failed"):  # the baseline of the row is required
        interleaved_times({"cudnn": broken, "fa4": lambda: 0.9}, timer, errors={}, required=("cudnn",))
    with pytest.raises(RuntimeError, match="capture failed"):  # without `errors`, as before
        interleaved_times(fns, timer)
