"""benchmarks/probe_served_path.py on the CPU with the tiny NucleusMoE: every mode runs, the table and the
profiles are written (the GPU numbers are in benchmarks/results/serving/)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_served_path_probe_times_every_mode_and_profiles(tmp_path):
    from benchmarks.probe_served_path import main

    assert main(["--model", "tiny-nucleusmoe", "--steps", "2", "--compile", "off", "--reps", "1", "--rounds", "1",
                 "--profile", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "served-path-tiny-nucleusmoe.json").read_text())
    rows = {r["how"]: r for r in data["rows"]}
    assert set(rows) == {"bare", "runner", "runner-thread", "runner-worker", "served", "worker queue",
                         "bare, server up", "bare, heap unfrozen", "served, heap unfrozen"}
    assert rows["bare"]["over_bare"] == 1 and all(r["median_s"] > 0 and r["calls"] == 1 for r in rows.values())
    assert all(rows[m]["step_ms"] > 0 for m in ("runner-worker", "served", "worker queue"))  # steps are timed
    assert all(r["gc_ms"] >= 0 and r["full_collections"] >= 0 for r in rows.values())
    assert rows["bare"]["cpu_s"] > 0 and "MainThread" in rows["bare"]["cpu_s_by_thread"]  # bare runs there
    assert "xstage-worker" in rows["served"]["cpu_s_by_thread"]  # the server's pipeline runs on its worker
    for name in ("bare", "runner-worker"):
        text = (tmp_path / f"served-path-tiny-nucleusmoe-profile-{name}.txt").read_text()
        assert "Self CPU" in text and "aten::" in text


@pytest.mark.slow
def test_served_path_probe_compares_the_guard_modes_on_the_same_graphs(tmp_path):
    from benchmarks.probe_served_path import main

    assert main(["--model", "tiny-nucleusmoe", "--steps", "2", "--compile", "regional", "--backend", "eager",
                 "--dtype", "bfloat16", "--reps", "1", "--rounds", "1", "--profile", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "served-path-tiny-nucleusmoe.json").read_text())
    rows = {r["how"]: r for r in data["rows"]}
    assert {"bare, warm guards", "served, warm guards"} <= set(rows)
    assert data["summary"]["compiled"]["guards"] == "full"  # switched for those modes' calls only, then back
    profiles = data["summary"]["profiles"]
    assert set(profiles) == {"bare", "runner-worker", "bare, warm guards"}
    full, warm = profiles["bare"], profiles["bare, warm guards"]
    assert full["cache_lookups"] == warm["cache_lookups"] > 0  # the same compiled frames, looked up alike
    assert full["host_ms"] > 0 and full["cache_lookup_ms"] > 0 and warm["cache_lookup_ms"] > 0
    assert (tmp_path / "served-path-tiny-nucleusmoe-profile-bare-warm-guards.txt").is_file()


def test_served_path_probe_refuses_a_video_model(tmp_path):
    from benchmarks.probe_served_path import main

    with pytest.raises(SystemExit, match="expected an image model"):
        main(["--model", "tiny-wan", "--out-dir", str(tmp_path)])
