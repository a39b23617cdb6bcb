"""benchmarks/bench_serving.py served-path on the CPU with the tiny NucleusMoE: every mode runs, the table and the
profiles are written (the GPU numbers are in benchmarks/results/serving/)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_served_path_times_every_mode_and_profiles(tmp_path):
    from benchmarks.bench_serving import main

    assert main(["served-path", "--model", "tiny-nucleusmoe", "--steps", "2", "--compile", "off", "--reps", "1", "--rounds", "1",
                 "--profile", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "served-path-tiny-nucleusmoe.json").read_text())
    rows = {r["how"]: r for r in data["rows"]}
    assert set(rows) == {"bare", "runner", "runner-thread", "runner-worker", "served", "worker queue",
                         "bare, server up", "bare, heap unfrozen", "served, heap unfrozen"}
    assert rows["bare"]["over_bare"] == 1 and all(r["median_s"] > 0 and r["calls"] == 1 for r in rows.values())
    assert all(rows[m]["step_ms"] > 0 for m in ("runner-worker", "served", "worker queue"))  # steps are timed
    # the served modes' delivery after the GPU: the PNG, then the answer's way to the client
    assert all(rows[m]["encode_ms"] > 0 and rows[m]["after_job_ms"] > 0 for m in ("served", "served, heap unfrozen"))
    assert rows["bare"]["encode_ms"] is None and rows["worker queue"]["encode_ms"] is None
    assert all(r["gc_ms"] >= 0 and r["full_collections"] >= 0 for r in rows.values())
    assert rows["bare"]["cpu_s"] > 0 and "MainThread" in rows["bare"]["cpu_s_by_thread"]  # bare runs there
    assert "xstage-worker" in rows["served"]["cpu_s_by_thread"]  # the server's pipeline runs on its worker
    for name in ("bare", "runner-worker"):
        text = (tmp_path / f"served-path-tiny-nucleusmoe-profile-{name}.txt").read_text()
        assert "Self CPU" in text and "aten::" in text
        # the call split by phase: encode_prompt twice (the prompt, then "" from the cache), two transformer
        # forwards a step (CFG), one VAE decode
        phases = data["summary"]["profiles"][name]["phases"]
        assert {k: v["calls"] for k, v in phases.items()} == {"text_encode": 2, "transformer": 4, "vae_decode": 1}
        assert all(v["host_ms"] > 0 for v in phases.values())


@pytest.mark.slow
def test_served_path_compares_the_guard_modes_on_the_same_graphs(tmp_path):
    from benchmarks.bench_serving import main

    assert main(["served-path", "--model", "tiny-nucleusmoe", "--steps", "2", "--compile", "regional", "--backend", "eager",
                 "--dtype", "bfloat16", "--reps", "1", "--rounds", "1", "--profile", "--pairs", "2",
                 "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "served-path-tiny-nucleusmoe.json").read_text())
    rows = {r["how"]: r for r in data["rows"]}
    assert {"bare, warm guards", "served, warm guards"} <= set(rows)
    assert all(r["calls"] == 1 for r in rows.values())  # the pairs' calls are not the modes' rows
    paired = {(p["mode"], p["against"]): p for p in data["summary"]["paired"]}
    assert set(paired) == {("served", "bare"), ("served, warm guards", "bare, warm guards")}
    for p in paired.values():
        assert p["pairs"] == 2 and len(p["seconds"]) == 2 and p["ratio"] > 0 and len(p["ci95"]) == 2
        assert p["target"] in ("met", "not met", "unresolved")
    assert data["summary"]["compiled"]["guards"] == "full"  # switched for those modes' calls only, then back
    profiles = data["summary"]["profiles"]
    assert set(profiles) == {"bare", "runner-worker", "bare, warm guards"}
    full, warm = profiles["bare"], profiles["bare, warm guards"]
    assert full["cache_lookups"] == warm["cache_lookups"] > 0  # the same compiled frames, looked up alike
    assert full["host_ms"] > 0 and full["cache_lookup_ms"] > 0 and warm["cache_lookup_ms"] > 0
    assert (tmp_path / "served-path-tiny-nucleusmoe-profile-bare-warm-guards.txt").is_file()


def test_served_path_refuses_a_video_model(tmp_path):
    from benchmarks.bench_serving import main

    with pytest.raises(SystemExit, match="expected an image model"):
        main(["served-path", "--model", "tiny-wan", "--out-dir", str(tmp_path)])


def test_paired_ratio_alternates_the_order_and_judges_the_target():
    from benchmarks._serving_served_path import paired_ratio

    calls = []
    clock = {"bare": [0.50, 0.52, 0.70, 0.51], "served": [0.505, 0.525, 0.707, 0.515]}

    def timed_call(name):
        calls.append(name)
        return clock[name].pop(0)

    p = paired_ratio("served", "bare", timed_call, 4)
    assert calls == ["bare", "served", "served", "bare"] * 2  # which comes first alternates pair by pair
    assert p["pairs"] == 4 and p["seconds"][2] == [0.707, 0.7]  # the slow spell hits both calls of pair 3
    assert 1.0095 < p["ratio"] < 1.0105 and p["target"] == "met" and p["ci95"][1] <= 1.02
    slow = paired_ratio("served", "bare", lambda name: 1.1 if name == "served" else 1.0, 3)
    assert slow["target"] == "not met" and slow["verdict"] == "slower"
    noisy = {"bare": [1.0, 1.0, 1.0], "served": [0.9, 1.2, 1.0]}
    assert paired_ratio("served", "bare", lambda name: noisy[name].pop(0), 3)["target"] == "unresolved"
