"""benchmarks/bench_vae_decode.py on the CPU (tiny VAEs): both variants decode, are timed, and agree to rounding."""

from __future__ import annotations

import json

import pytest


def test_vae_decode_bench_times_3d_and_2d_and_reports_their_difference(tmp_path):
    from benchmarks.bench_vae_decode import main

    assert main(["--size", "tiny", "--cases", "nucleusmoe:64x64x1,wan:32x48x2", "--rounds", "2", "--reps", "1",
                 "--warmup", "0", "--out-dir", str(tmp_path), "--tag", "test"]) == 0
    data = json.loads((tmp_path / "vae-decode-test.json").read_text())
    rows = {r["case"]: r for r in data["rows"]}
    assert set(rows) == {"nucleusmoe:64x64x1", "wan:32x48x2"}
    for row in rows.values():
        assert row["convs_2d"] > 0 and row["ms_3d"] > 0 and row["ms_2d"] > 0
        assert len(row["rounds_3d"]) == len(row["rounds_2d"]) == 2
        assert row["max_abs_diff"] < 1e-2  # the same convolution summed in another order
    assert rows["wan:32x48x2"]["dtype"] == "float32" and rows["nucleusmoe:64x64x1"]["dtype"] == "bfloat16"
    assert set(data["summary"]["speedup_by_case"]) == set(rows)


@pytest.mark.parametrize("case", ["flux:64x64x1", "wan:64x64", "wan:63x64x1", "wan:64x64x0"])
def test_a_bad_case_is_named(case):
    from benchmarks.bench_vae_decode import parse_case

    with pytest.raises(ValueError, match="expected"):
        parse_case(case)
