"""benchmarks/bench_row_quant.py on the CPU at tiny shapes (a smoke run): every candidate runs and is timed, the
quantizers agree with the op bit for bit (the eager backend keeps the reference's GELU rounding), and bad shapes are
named."""

from __future__ import annotations

import json

import pytest


def test_row_quant_bench_times_every_candidate_on_the_cpu(tmp_path):
    from benchmarks.bench_row_quant import CANDIDATES, main

    assert main(["--device", "cpu", "--backend", "eager", "--shapes", "8x16+40g,5x0+33g,4x24", "--rounds", "2",
                 "--reps", "2", "--warmup", "1", "--inner", "2", "--out-dir", str(tmp_path), "--tag", "test"]) == 0
    data = json.loads((tmp_path / "row-quant-test.json").read_text())
    assert (tmp_path / "row-quant-test.md").is_file()
    rows = {(r["shape"], r["candidate"]): r for r in data["rows"]}
    assert set(rows) == {(s, c) for s in ("8x16+40g", "5x0+33g", "4x24") for c in CANDIDATES}
    for (_, candidate), row in rows.items():
        assert row["median_us"] > 0 and row["p20_us"] <= row["p80_us"] and row["gbps"] >= 0
        assert len(row["rounds_us"]) == 2 and row["vs_inductor"] > 0
        if candidate != "copy":
            assert row["bytes_differing"] == 0 and row["scales_differing"] == 0, row
    assert data["environment"]["torch"]


@pytest.mark.parametrize("shape", ["4096", "4096x", "0x12", "4x0", "4x3g", "4x3+5q"])
def test_a_bad_shape_is_named(shape):
    from benchmarks.bench_row_quant import parse_shape

    with pytest.raises(ValueError, match="expected"):
        parse_shape(shape)


def test_shapes_parse():
    from benchmarks.bench_row_quant import parse_shape

    assert parse_shape("4608x3072+12288g") == (4608, 3072, 12288, True)
    assert parse_shape("4096x3072") == (4096, 3072, 0, False)
    assert parse_shape("4096x0+12288") == (4096, 0, 12288, False)
