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
        bench_fp8_error.main(["--variants", "bf16,fp8-block"])
    assert "fp8-block" in capsys.readouterr().err
