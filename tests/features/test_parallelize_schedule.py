"""One place decides the attention schedule: ``parallelize`` resolves the params once (`params_for`) and
each shape's schedule once (`AttentionSchedules`), in eager code and under torch.compile alike; the op is
handed the name. World 1 on the CPU here; the world-2 case (the op called with the recorded schedule, eager
and compiled) runs in tests/features/test_parallelize.py::test_parallel_pipelines_match_single_process."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from xstage_dit.features import ParallelConfig, parallelize
from xstage_dit.features.attention_schedules import AttentionSchedules
from xstage_dit.schedule.facts import DeviceFacts

ROOT = Path(__file__).resolve().parents[2]
LOGGER = "xstage_dit.features.attention_schedules"


def _tiny_flux():
    sys.path.insert(0, str(ROOT / "tests" / "features"))
    import _parallelize_worker as worker

    return worker._flux(heads=2)


def _image(pipe):
    out = pipe(prompt="a fox", height=32, width=32, num_inference_steps=2, max_sequence_length=8,
               generator=torch.Generator().manual_seed(0), output_type="np")
    return np.asarray(out.images, dtype=np.float32)


def _decisions(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "attention schedule for" in r.getMessage()]


def test_eager_and_compiled_choose_the_same_once_per_shape(caplog):
    pipe = _tiny_flux()
    pipe.set_progress_bar_config(disable=True)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with parallelize(pipe, ParallelConfig(calibrate=False)) as eager:
            ref = _image(pipe)
            _image(pipe)  # a second run decides nothing new
        eager_logs = _decisions(caplog)
        caplog.clear()
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        with parallelize(pipe, ParallelConfig(calibrate=False)) as compiled:
            pipe.transformer.compile(backend="eager")
            try:
                out = _image(pipe)
                _image(pipe)
                graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
            finally:
                torch._dynamo.reset()
                pipe.transformer._compiled_call_impl = None  # back to the eager forward
        compiled_logs = _decisions(caplog)
    assert graphs >= 1 and breaks == 0, (graphs, dict(counters["graph_break"]))  # the decision ran while tracing
    assert eager.schedule_choices and compiled.schedule_choices == eager.schedule_choices
    assert {d.name for d in eager.schedule_choices.values()} == {"serial"}
    # one log line per distinct shape, with the same reason, whether decided in eager code or while tracing
    assert len(eager_logs) == len(eager.schedule_choices) and compiled_logs == eager_logs
    assert "world size 1" in eager_logs[0] or "fused kernel unavailable" in eager_logs[0]
    # Paths are recorded by eager calls only: reading a module's name while tracing would guard every
    # compiled block on it (one graph per block; tests/features/test_compile.py).
    assert list(eager.attention_paths) == ["local"] and list(compiled.attention_paths) == []
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=0)


def test_params_are_resolved_once_by_the_provider(monkeypatch):
    import xstage_dit.features.setup as setup
    from xstage_dit.calibration.provider import ChosenParams

    calls = []

    def fake_params_for(device, group, *, allow_measure):
        calls.append((device, group, allow_measure))
        return ChosenParams(None, "local", "no calibration (test)")

    monkeypatch.setattr(setup, "params_for", fake_params_for)
    pipe = _tiny_flux()
    with parallelize(pipe, ParallelConfig(calibrate=False)) as handle:
        assert handle.calibration.source == "no calibration (test)"
    assert calls == [(handle.groups.device, handle.groups.sp_group, False)]
    with parallelize(pipe, ParallelConfig(schedule="serial")) as fixed:
        assert fixed.calibration is None  # a fixed schedule needs no params
    assert len(calls) == 1


def test_a_user_schedule_is_handed_through_and_bad_ones_are_refused():
    book = AttentionSchedules("fused", world=2, facts=DeviceFacts.cpu())
    assert book.for_shape(1, 64, 4, 16, torch.float32, torch.device("cpu")) == "fused" and book.choices == {}
    with pytest.raises(ValueError, match="'auto', 'fused' or 'serial', got 'fast'"):
        AttentionSchedules("fast", world=2, facts=DeviceFacts.cpu())
    with pytest.raises(ValueError, match="attention path in .*got 'sideways'"):
        book.note_path("sideways", "x")
