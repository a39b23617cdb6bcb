"""benchmarks/_fp8_rows_probe.py (`bench_fp8_error.py probe-rows`): the linear shapes it tries (each family record's fp8_row_refused among them, by
path) and its refusal of a machine without a GPU (what it probes is torch's FP8 GEMM)."""

from __future__ import annotations

import pytest
import torch


def test_shapes_group_the_layers_and_find_the_refused_one():
    from benchmarks._fp8_rows_probe import shapes

    by_shape, refused = shapes("tiny-nucleusmoe")
    assert refused == {"time_text_embed.timestep_embedder.linear_2": "time_text_embed.timestep_embedder.linear_2"}
    (path,) = refused
    paths = [p for ps in by_shape.values() for p in ps]
    assert len(paths) == len(set(paths)) and path in paths
    (k, n, bias), = [s for s, ps in by_shape.items() if path in ps]
    assert k == 4 * n and bias  # the one-row layer whose contraction is 4x its output
    assert shapes("tiny-flux")[1] == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_a_machine_without_a_gpu():
    from benchmarks import bench_fp8_error

    with pytest.raises(SystemExit, match="probe-rows needs a CUDA GPU"):
        bench_fp8_error.main(["probe-rows", "--models", "tiny-flux"])


def test_failure_facts_bisect_to_the_least_running_row_count_and_try_the_shape_without_bias(monkeypatch):
    from benchmarks import _fp8_rows_probe as probe

    calls = []

    def run_shape(k, n, bias, rows):  # a GEMM that refuses k -> n with a bias below 300 rows, and never without
        calls.append((bias, rows))
        return "CUBLAS_STATUS_NOT_SUPPORTED" if bias and rows < 300 else None

    monkeypatch.setattr(probe, "run_shape", run_shape)
    errors = {r: run_shape(8192, 2048, True, r) for r in (1, 2, 16, 4096)}
    facts = probe.failure_facts(8192, 2048, True, errors)
    assert facts == {"runs_from_rows": 300, "without_bias_at_16_rows": None}
    assert (False, 16) in calls
    # none of the tried counts ran: no threshold to bisect; a bias-free shape has no bias to drop
    monkeypatch.setattr(probe, "run_shape", lambda k, n, bias, rows: "refused")
    assert probe.failure_facts(64, 64, False, {1: "refused", 2: "refused"}) == {"runs_from_rows": None}
