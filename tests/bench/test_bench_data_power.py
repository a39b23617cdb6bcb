"""benchmarks/bench_data_power.py: its operands (random, NaN, zero of the same shape and dtype) and its refusal of
a machine without a GPU (the effect it measures is the GPU's power limit)."""

from __future__ import annotations

import math

import pytest
import torch


def test_filled_keeps_shape_and_dtype_and_holds_the_fill():
    from benchmarks.bench_data_power import filled

    x = torch.randn(3, 5, dtype=torch.bfloat16)
    assert filled(x, None) is x
    nan = filled(x, float("nan"))
    assert nan.shape == x.shape and nan.dtype == x.dtype and bool(nan.isnan().all())
    zero = filled(x.to(torch.float8_e4m3fn), 0.0)
    assert zero.dtype == torch.float8_e4m3fn and float(zero.float().abs().max()) == 0.0
    assert math.isnan(float(filled(x.to(torch.float8_e4m3fn), float("nan")).float()[0, 0]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_a_machine_without_a_gpu(capsys):
    from benchmarks import bench_data_power

    with pytest.raises(SystemExit):
        bench_data_power.main(["--reps", "1"])
    assert "expected a CUDA device" in capsys.readouterr().err
