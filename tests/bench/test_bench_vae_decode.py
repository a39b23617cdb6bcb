"""benchmarks/bench_vae_decode.py on the CPU (tiny VAEs): every variant decodes, is timed, and agrees to rounding."""

from __future__ import annotations

import json

import pytest


def test_vae_decode_bench_times_3d_and_2d_and_reports_their_difference(tmp_path):
    from benchmarks.bench_vae_decode import main

    assert main(["--size", "tiny", "--cases", "nucleusmoe:64x64x1,wan:32x48x2", "--rounds", "2", "--reps", "1",
                 "--warmup", "0", "--backend", "eager", "--out-dir", str(tmp_path), "--tag", "test"]) == 0
    data = json.loads((tmp_path / "vae-decode-test.json").read_text())
    rows = {r["case"]: r for r in data["rows"]}
    assert set(rows) == {"nucleusmoe:64x64x1", "wan:32x48x2"}
    for row in rows.values():
        assert row["convs_2d"] > 0 and min(row["ms_3d"], row["ms_2d"], row["ms_2d_compile"]) > 0
        assert len(row["rounds_3d"]) == len(row["rounds_2d"]) == len(row["rounds_2d_compile"]) == 2
        # the same convolutions summed in another order
        assert row["max_abs_diff_2d"] < 1e-2 and row["max_abs_diff_2d_compile"] < 1e-2
    assert rows["wan:32x48x2"]["dtype"] == "float32" and rows["nucleusmoe:64x64x1"]["dtype"] == "bfloat16"
    assert set(data["summary"]["speedup_2d_compile_by_case"]) == set(rows)


@pytest.mark.parametrize("case", ["flux:64x64x1", "wan:64x64", "wan:63x64x1", "wan:64x64x0"])
def test_a_bad_case_is_named(case):
    from benchmarks.bench_vae_decode import parse_case

    with pytest.raises(ValueError, match="expected"):
        parse_case(case)
