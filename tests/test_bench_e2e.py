"""CPU tests of the end-to-end benchmark (`benchmarks/bench_e2e.py`, `xstage-dit bench`).

The end-to-end test runs the real script on the tiny FLUX pipeline (1 prompt, 2 steps) through the
`xstage-dit bench` entry point and checks what it writes; the others check the pieces whose numbers
end up in the committed tables (percentiles, speedups, budget decisions, the transformer timer).
"""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest
import torch

from xstage_dit import cli
from xstage_dit.commands import bench as bench_cli

bench = bench_cli.load_script()


def _patches_importable() -> bool:
    try:
        from xstage_dit.patches import ParallelConfig, parallelize  # noqa: F401
    except Exception:
        return False
    return True


# ----------------------------------------------------------------------------------------------------
# Inputs and helpers


def test_prompts_file_is_a_varied_dozen():
    prompts = bench.load_prompts(bench_cli.REPO_ROOT / "benchmarks" / "prompts.txt")
    assert len(prompts) == 12
    assert len(set(prompts)) == 12
    assert any(len(p.split()) <= 3 for p in prompts), "expected a short prompt"
    assert any(len(p.split()) > 70 for p in prompts), "expected a long prompt (past CLIP's 77-token window)"
    assert sum(any(ord(ch) > 127 for ch in p) for p in prompts) >= 3, "expected several non-ASCII prompts"
    assert bench.load_prompts(bench_cli.REPO_ROOT / "benchmarks" / "prompts.txt", 2) == prompts[:2]


def test_load_prompts_skips_comments_and_rejects_too_many(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("# comment\n\n  first  \nsecond\n", encoding="utf-8")
    assert bench.load_prompts(path) == ["first", "second"]
    with pytest.raises(ValueError, match="num-prompts <= 2.*got 3"):
        bench.load_prompts(path, 3)
    path.write_text("# only a comment\n", encoding="utf-8")
    with pytest.raises(ValueError, match="at least one prompt"):
        bench.load_prompts(path)


def test_percentile_interpolates_between_order_statistics():
    assert bench.percentile([4.0, 1.0, 3.0, 2.0], 90) == pytest.approx(3.7)
    assert bench.percentile([5.0], 90) == 5.0
    values = list(np.random.default_rng(0).random(11))
    assert bench.percentile(values, 50) == pytest.approx(statistics.median(values))


def test_model_slug_and_gpu_label():
    assert bench.model_slug("full-flux") == "full-flux"
    assert bench.model_slug("/data/models/FLUX.1-dev") == "FLUX.1-dev"
    assert bench.gpu_label(torch.device("cpu")) == "cpu"


def test_transformer_timer_counts_each_forward_and_detaches():
    module = torch.nn.Linear(8, 8)
    timer = bench.TransformerTimer(module, torch.device("cpu"))
    for _ in range(3):
        module(torch.randn(2, 8))
    total_s, calls = timer.collect()
    assert calls == 3 and total_s > 0
    assert timer.collect() == (0, 0)  # collect starts a new window
    timer.remove()
    module(torch.randn(2, 8))
    assert timer.collect() == (0, 0)


# ----------------------------------------------------------------------------------------------------
# Options: one-line errors naming the bad value


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--steps", "0"], "--steps >= 1, got 0"),
        (["--num-prompts", "-1"], "--num-prompts >= 1, got -1"),
        (["--warmup", "-2"], "--warmup >= 0, got -2"),
        (["--contenders", "diffusers,vllm"], "'diffusers,vllm'"),
        (["--prompts", "/nonexistent/prompts.txt"], "/nonexistent/prompts.txt"),
        (["--model", "no-such-model"], "no-such-model"),
        (["--num-prompts", "13"], "got 13"),
        (["--height", "100"], "height to be a positive multiple of 16 for tiny-flux, got 100"),
    ],
)
def test_bad_option_values_give_one_line_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("xstage-dit: error:") and "\n" not in err
    assert needle in err


def test_gpus_must_match_the_launched_ranks(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")  # as under torchrun --nproc-per-node 3
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--gpus", "2"])
    assert exc.value.code == 2
    assert "expected --gpus to equal the launched ranks (WORLD_SIZE=3), got --gpus 2" in capsys.readouterr().err


def test_help_lists_every_contender(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    for name in bench_cli.CONTENDERS:
        assert name in out
    assert "--compile" in out and "--time-budget-s" in out


# ----------------------------------------------------------------------------------------------------
# Results: summary, comparisons, run order, budget


def _ok(name, median, step_s=0.1, compile=False):
    family = name.replace("+compile", "")
    return {"name": name, "family": family, "compile": compile, "status": "ok",
            "median_s": median, "p90_s": median, "transformer_step_ms": 1e3 * step_s, "warmup_s": 1.0}


def test_summary_and_comparisons_are_the_measured_ratios():
    records = [
        _ok("diffusers", 2.0),
        _ok("xstage-serial", 1.6),
        _ok("xstage-calibrated", 1.25),
        _ok("diffusers+compile", 1.0, compile=True),
        _ok("xstage-serial+compile", 0.8, compile=True),
        {"name": "xfuser-usp", "family": "xfuser-usp", "compile": False, "status": "cannot run", "reason": "why"},
    ]
    bench.add_comparisons(records, default_steps=28, steps=4)
    summary = bench.build_summary(records, {"steps": 4})
    by = summary["contenders"]
    assert summary["baseline"] == "diffusers" and summary["measured_at_steps"] == 4
    assert by["diffusers"]["speedup_vs_diffusers_1gpu"] == pytest.approx(1.0)
    assert by["xstage-calibrated"] == {"status": "ok", "median_latency_s": 1.25, "speedup_vs_diffusers_1gpu": pytest.approx(1.6)}
    assert by["xstage-serial+compile"]["speedup_vs_diffusers_1gpu"] == pytest.approx(2.5)
    assert by["xfuser-usp"] == {"status": "cannot run", "reason": "why"}
    rec = {r["name"]: r for r in records}
    assert rec["xstage-calibrated"]["speedup_vs_xstage_serial"] == pytest.approx(1.28)
    assert rec["xstage-serial+compile"]["speedup_vs_diffusers_same_compile"] == pytest.approx(1.25)
    assert "baseline_drift_pct" not in rec["diffusers"]  # no repeat measured: no drift, no verdict
    assert "not_slower_than_diffusers" not in rec["xstage-serial"]
    # 24 missing steps at the measured 0.1 s/step, labelled as an extrapolation.
    assert rec["diffusers"]["latency_s_at_default_steps_extrapolated"] == pytest.approx(2.0 + 24 * 0.1)


def test_run_order_baseline_first_irreversible_last():
    order = [c.name for c in bench.make_contenders(list(bench_cli.CONTENDERS), True, world_size=4)]
    assert order[0] == "diffusers"
    assert order[-4:] == ["xfuser-usp", "xfuser-usp+compile", "diffusers-cp", "diffusers-cp+compile"]
    assert order[:7] == ["diffusers", "xstage-serial", "xstage-calibrated", "diffusers-repeat", "diffusers+compile",
                         "xstage-serial+compile", "xstage-calibrated+compile"]
    order1 = [c.name for c in bench.make_contenders(list(bench_cli.CONTENDERS), True, world_size=1)]
    assert order1[-4:] == ["xfuser-usp", "xfuser-usp+compile", "diffusers-cp", "diffusers-cp+compile"]
    assert len(order1) == len(set(order1)) == 11
    # No xstage contender, no repeat.
    assert [c.name for c in bench.make_contenders(["diffusers", "xfuser-usp"], False)][:2] == ["diffusers", "diffusers+compile"]
    skipped = bench.make_contenders(["diffusers"], False)
    assert [c.info.get("skip_reason") for c in skipped] == [None, "torch.compile variants not requested (--compile)"]


class _Args:
    compile_estimate_s = 100.0
    compile_mode = "regional"
    time_budget_s = 0.0


class _FakePipe:
    """Stands in for a pipeline: a transformer module called `steps` times per generation."""

    def __init__(self):
        self.transformer = torch.nn.Linear(4, 4)

    def __call__(self, num_inference_steps, **_):
        for _ in range(num_inference_steps):
            self.transformer(torch.randn(1, 4))
        return type("Out", (), {"images": np.zeros((1, 2, 2, 3), np.float32)})()


def _fake_bench(**over):
    class FakeBench(bench.Bench):
        def call_kwargs(self, prompt, steps):
            return {"num_inference_steps": steps}

    args = _Args()
    args.warmup, args.warmup_steps = 1, 1
    fields = dict(args=args, spec=None, pipe=_FakePipe(), device=torch.device("cpu"), dtype=torch.float32,
                  rank=0, world_size=1, prompts=["a", "b", "c"], steps=3, height=8, width=8, frames=1,
                  t_start=0.0, build_s=7.0)
    fields.update(over)
    return FakeBench(**fields)


def test_budget_estimate_uses_the_measured_baseline():
    b = _fake_bench()
    baseline = _ok("diffusers", 2.0)
    plain, compiled = bench.PlainDiffusers(False), bench.PlainDiffusers(True)
    assert bench.estimate_cost_s(b, plain, None) is None  # nothing measured yet: run it
    assert bench.estimate_cost_s(b, plain, baseline) == pytest.approx(1.0 + 3 * 2.0)
    assert bench.estimate_cost_s(b, compiled, baseline) == pytest.approx(1.0 + 3 * 2.0 + 100.0)
    b.dirty = "xfuser-usp"  # a pristine pipeline has to be built again first
    assert bench.estimate_cost_s(b, plain, baseline) == pytest.approx(1.0 + 3 * 2.0 + 7.0)


def test_measure_times_every_prompt_and_counts_forwards():
    b = _fake_bench()
    record, output = bench.measure(b, bench.PlainDiffusers(False), None)
    assert record["status"] == "ok", record
    assert len(record["latencies_s"]) == 3 and record["median_s"] == statistics.median(record["latencies_s"])
    assert record["transformer_forwards_per_step"] == 1.0
    assert record["transformer_step_ms"] > 0
    assert output.shape == (2, 2, 3)


def test_measure_reports_a_failing_contender_and_undoes_it():
    events = []

    class Broken(bench.Contender):
        family = "broken"

        def apply(self, b):
            events.append("apply")

        def call(self, b, kwargs):
            raise RuntimeError("boom at step 1")

        def restore(self, b):
            events.append("restore")

    b = _fake_bench()
    record, output = bench.measure(b, Broken(False), None)
    assert record["status"] == "failed" and "RuntimeError: boom at step 1" in record["reason"]
    assert events == ["apply", "restore"] and output is None
    assert b.pipe.transformer._forward_hooks == {}  # the timer's hooks are gone too


# ----------------------------------------------------------------------------------------------------
# End to end on the tiny FLUX pipeline (CPU)


def test_end_to_end_tiny_flux_writes_json_md_png(tmp_path, capsys):
    rc = cli.main([
        "bench", "--model", "tiny-flux", "--num-prompts", "1", "--steps", "2", "--out-dir", str(tmp_path),
        # Compile variants are requested but cannot fit the budget: reported as skipped, never omitted.
        "--compile", "--compile-estimate-s", "1e6", "--time-budget-s", "1e5",
    ])
    assert rc == 0
    stem = tmp_path / "e2e-tiny-flux-1xcpu"
    record = json.loads(stem.with_suffix(".json").read_text(encoding="utf-8"))
    rows = {r["name"]: r for r in record["rows"]}
    expected = {n + s for n in bench_cli.CONTENDERS for s in ("", "+compile")} | {"diffusers-repeat"}
    assert set(rows) == expected

    base = rows["diffusers"]
    assert base["status"] == "ok"
    assert len(base["latencies_s"]) == 1 and base["median_s"] > 0
    assert 0 < base["transformer_step_ms"] / 1e3 < base["median_s"]
    assert base["transformer_forwards_per_step"] == 1.0  # FLUX.1-dev: guidance-distilled, one forward a step
    assert base["peak_memory_gib"] is None  # CPU

    for name, row in rows.items():
        assert row["status"] in ("ok", "cannot run", "skipped", "failed"), row
        if row["status"] != "ok":
            assert row["reason"], f"{name} has no reason"
        if name.endswith("+compile"):
            eager = rows[name.replace("+compile", "")]
            if eager["status"] == "cannot run":  # the same detected reason, before any budget question
                assert (row["status"], row["reason"]) == ("cannot run", eager["reason"])
            else:
                assert row["status"] == "skipped" and row["reason"].startswith("time budget"), row
    # diffusers' native context parallelism needs an accelerator (and refuses degree 1): detected, not assumed.
    assert rows["diffusers-cp"]["status"] == "cannot run"
    assert "needs an accelerator" in rows["diffusers-cp"]["reason"]
    assert rows["xfuser-usp"]["status"] == "cannot run"
    if _patches_importable():
        for name in ("xstage-serial", "xstage-calibrated"):
            assert rows[name]["status"] == "ok", rows[name]
            # Same seed, same prompt, world 1, fp32: the same image as plain diffusers.
            assert rows[name]["output_max_abs_diff_vs_diffusers"] < 1e-3
            assert isinstance(rows[name]["not_slower_than_diffusers"], bool)  # judged against the A/B/A baselines
        assert rows["diffusers-repeat"]["status"] == "ok" and "baseline_drift_pct" in rows["diffusers"]

    summary = record["summary"]
    assert summary["measured_at_steps"] == 2 and summary["baseline"] == "diffusers"
    assert set(summary["contenders"]) == expected
    assert summary["contenders"]["diffusers"]["speedup_vs_diffusers_1gpu"] == pytest.approx(1.0)
    assert math.isclose(summary["contenders"]["diffusers"]["median_latency_s"], base["median_s"])
    settings = summary["settings"]
    assert (settings["steps"], settings["default_steps"], settings["num_prompts"]) == (2, 4, 1)
    assert record["environment"]["torch"] and record["environment"]["git_commit"]
    assert settings["command"].startswith("xstage-dit bench") and "--steps 2" in settings["command"]

    md = stem.with_suffix(".md").read_text(encoding="utf-8")
    assert "measured at 2 denoising steps" in md
    for name in expected:
        assert f"| {name} |" in md
    assert "time budget" in md

    png = stem.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(png) as image:
        assert image.width > 200 and image.height > 200
    assert "wrote" in capsys.readouterr().out


def test_diffusers_cp_reasons_are_detected(monkeypatch):
    b = _fake_bench()
    cp = bench.DiffusersCP(False)
    if torch.accelerator.device_count() == 0:
        assert "needs an accelerator" in cp.check(b)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    assert "Linear ships no _cp_plan" in cp.check(b)
    b.pipe.transformer._cp_plan = {"": {}}
    reason = cp.check(b)  # world 1: diffusers itself refuses a Ulysses degree of 1
    assert "ContextParallelConfig(ulysses_degree=1) refuses" in reason and "greater than 1" in reason


def test_two_ranks_agree_and_rank0_writes(tmp_path):
    """2 CPU ranks (gloo), started by the script itself (xstage_dit.launch) or, before that exists, by
    torchrun: every rank takes the same decisions, rank 0 writes the files."""
    import importlib.util
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(bench_cli.REPO_ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    options = ["--model", "tiny-flux", "--gpus", "2", "--device", "cpu", "--num-prompts", "1", "--steps", "1",
               "--warmup", "0", "--contenders", "diffusers,xstage-serial", "--out-dir", str(tmp_path)]
    if importlib.util.find_spec("xstage_dit.launch") is not None:
        cmd = [sys.executable, str(bench_cli.SCRIPT), *options]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(bench_cli.SCRIPT), *options]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"e2e-tiny-flux-2xcpu.{s}" for s in ("json", "md", "png")]
    record = json.loads((tmp_path / "e2e-tiny-flux-2xcpu.json").read_text(encoding="utf-8"))
    assert record["summary"]["settings"]["gpus"] == record["summary"]["settings"]["world_size"] == 2
    rows = {r["name"]: r for r in record["rows"]}
    assert rows["diffusers"]["status"] == "ok"
    assert proc.stdout.count("[bench] diffusers: ok") == 1  # rank 0 reports, the other rank is silent
    if _patches_importable():
        assert rows["xstage-serial"]["status"] == "ok", rows["xstage-serial"]
        assert rows["xstage-serial"]["parallel_config"]["sp"] == 2
        assert rows["xstage-serial"]["output_max_abs_diff_vs_diffusers"] < 1e-3


@pytest.mark.gpu
def test_end_to_end_tiny_flux_gpu(tmp_path):
    """The CUDA paths: event timing of the call and of every transformer forward, peak memory, GPU label."""
    rc = cli.main(["bench", "--model", "tiny-flux", "--device", "cuda", "--num-prompts", "2", "--steps", "2",
                   "--contenders", "diffusers,xstage-serial", "--out-dir", str(tmp_path)])
    assert rc == 0
    (json_path,) = tmp_path.glob("e2e-tiny-flux-1x*.json")
    assert not json_path.name.endswith("1xcpu.json")
    record = json.loads(json_path.read_text(encoding="utf-8"))
    assert record["environment"]["gpu"]
    rows = {r["name"]: r for r in record["rows"]}
    base = rows["diffusers"]
    assert base["status"] == "ok" and base["median_s"] > 0
    assert 0 < base["transformer_step_ms"] / 1e3 < base["median_s"]
    assert base["transformer_forwards_per_step"] == 1.0
    assert base["peak_memory_gib"] > 0
    assert record["summary"]["settings"]["dtype"] == "bfloat16"
    if _patches_importable():
        assert rows["xstage-serial"]["status"] == "ok", rows["xstage-serial"]
        assert rows["xstage-serial"]["output_max_abs_diff_vs_diffusers"] < 0.2  # bf16: kernels may differ; garbage is ~0.5+


def test_measure_undoes_a_half_applied_contender():
    events = []

    class HalfApplied(bench.Contender):
        family = "half"

        def apply(self, b):
            events.append("apply")
            raise ValueError("expected sp to divide 24 heads, got sp=5")

        def restore(self, b):
            events.append("restore")

    record, _ = bench.measure(_fake_bench(), HalfApplied(False), None)
    assert record["status"] == "failed" and "expected sp to divide 24 heads" in record["reason"]
    assert events == ["apply", "restore"]


def test_repeat_baseline_gives_the_drift_and_the_not_slower_verdict():
    records = [_ok("diffusers", 2.00), _ok("xstage-serial", 2.015), _ok("xstage-calibrated", 2.05),
               _ok("diffusers-repeat", 2.02), _ok("xstage-serial+compile", 3.0, compile=True)]
    bench.add_comparisons(records, default_steps=4, steps=4)
    rec = {r["name"]: r for r in records}
    assert rec["diffusers"]["baseline_drift_pct"] == pytest.approx(1.0)
    assert rec["xstage-serial"]["not_slower_than_diffusers"] is True       # 2.015 <= max(2.00, 2.02)
    assert rec["xstage-calibrated"]["not_slower_than_diffusers"] is False  # 2.05 > 2.02
    assert "not_slower_than_diffusers" not in rec["xstage-serial+compile"]
    summary = bench.build_summary(records, {"steps": 4})["contenders"]
    assert summary["xstage-calibrated"]["not_slower_than_diffusers"] is False
    assert summary["diffusers"]["baseline_drift_pct"] == pytest.approx(1.0)
