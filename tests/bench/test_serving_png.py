"""benchmarks/bench_serving.py png on the CPU: both encoders write the same bytes and are timed, each in a process
of its own, and the old chained assembly of a 1024² image of noise page-faults for its copies where the one join
does not (the H200 host's 8.6-9.1 ms encodes; benchmarks/results/serving/NOTES.md)."""

from __future__ import annotations

import json
import sys

import pytest


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts page faults with getrusage (Linux)")
def test_png_encode_times_the_encoders_and_counts_the_faults(tmp_path):
    from benchmarks._serving_png import ENCODERS
    from benchmarks.bench_serving import main

    assert main(["png", "--calls", "6", "--rounds", "1", "--pause-ms", "5", "--out-dir", str(tmp_path), "--tag", "test"]) == 0
    data = json.loads((tmp_path / "png-encode-test.json").read_text())
    rows = {(r["image"], r["encoder"]): r for r in data["rows"]}
    assert set(rows) == {(f"{image} 1024x1024", name) for image in ("noise", "smooth") for name in ENCODERS}
    assert all(r["median_ms"] > 0 and r["calls"] == 3 for r in rows.values())
    one, chained, kept = (rows[("noise 1024x1024", name)] for name in ENCODERS)
    assert one["bytes"] == chained["bytes"] == kept["bytes"]
    copy_pages = 1024 * 1024 * 3 // 4096
    assert one["faults_per_call"] < copy_pages < 3 * copy_pages < chained["faults_per_call"], (one, chained)
    assert kept["faults_per_call"] < copy_pages, kept
