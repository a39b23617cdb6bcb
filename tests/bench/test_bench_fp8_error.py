"""benchmarks/bench_fp8_error.py on the tiny FLUX (CPU: weight-only FP8, the mode a CPU runs): one row per seed and
variant, each a real relative L2 against the fp32-transformer run, and the summary their mean and ratio."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torchao", reason="torchao is a pinned dependency: the FP8 feature needs it")


def test_fp8_error_rows_and_summary(tmp_path):
    from benchmarks import bench_fp8_error

    rc = bench_fp8_error.main(["--model", "tiny-flux", "--seeds", "2", "--steps", "1", "--height", "32", "--width",
                               "32", "--variants", "bf16,fp8-weight", "--device", "cpu", "--out-dir", str(tmp_path),
                               "--tag", "cpu"])
    assert rc == 0
    record = json.loads((tmp_path / "fp8-error-tiny-flux-cpu.json").read_text())
    rows = record["rows"]
    assert [(r["variant"], r["seed"]) for r in rows] == [("bf16", 0), ("fp8-weight", 0), ("bf16", 1), ("fp8-weight", 1)]
    assert all(0 < r["rel_l2_vs_fp32"] < 0.5 for r in rows)
    summary = record["summary"]
    for variant in ("bf16", "fp8-weight"):
        values = [r["rel_l2_vs_fp32"] for r in rows if r["variant"] == variant]
        assert summary[variant]["mean"] == pytest.approx(sum(values) / 2) and summary[variant]["seeds"] == 2
    assert summary["fp8-weight"]["over_bf16"] == pytest.approx(summary["fp8-weight"]["mean"] / summary["bf16"]["mean"])


def test_unknown_variant_is_refused_naming_it(capsys):
    from benchmarks import bench_fp8_error

    with pytest.raises(SystemExit):
        bench_fp8_error.main(["--variants", "bf16,fp8-col"])
    assert "fp8-col" in capsys.readouterr().err


def test_fp8_attention_variants_ask_for_each_kernel_through_the_backend():
    import torch

    from benchmarks import bench_fp8_error

    assert {"fp8-row+cudnn-fp8", "fp8-row+sage", "fp8-tensor+sage"} <= set(bench_fp8_error.VARIANTS)
    config = bench_fp8_error.engine_config("fp8-row+sage", torch.device("cpu"))
    assert (config.quantize, config.fp8_granularity, config.fp8_attention) == ("fp8", "row", "sage")
    assert config.parallel is not None and config.parallel.sp == 1  # the attention backend at world 1
    plain = bench_fp8_error.engine_config("fp8-tensor", torch.device("cpu"))
    assert plain.parallel is None and plain.fp8_attention == "off"


def test_the_attention_table_refuses_unknown_shapes_and_a_cpu(capsys):
    import torch

    from benchmarks import _fp8_attention, bench_fp8_error

    assert set(_fp8_attention.SHAPES) == {"flux", "wan", "nucleus"}
    assert _fp8_attention.SHAPES["flux"][:3] == (4608, 24, 128) and _fp8_attention.SHAPES["wan"][:3] == (32760, 40, 128)
    with pytest.raises(SystemExit, match="expected --attention-shapes from flux,wan,nucleus, got 'flux,sd3'"):
        bench_fp8_error.main(["--attention", "--attention-shapes", "flux,sd3"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="expected a CUDA device"):
            bench_fp8_error.main(["--attention", "--attention-shapes", "flux"])
