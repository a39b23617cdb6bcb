"""CPU tests of the end-to-end benchmark (`xstage_dit.bench`, `xstage-dit bench`).

The end-to-end test runs the real script on the tiny FLUX pipeline (1 prompt, 2 steps) through the
`xstage-dit bench` entry point and checks what it writes; the others check the pieces whose numbers
end up in the committed tables (percentiles, speedups, budget decisions, the transformer timer).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import time

import numpy as np
import pytest
import torch

from xstage_dit import cli
from xstage_dit.errors import UsageError
from xstage_dit.bench import contenders, fp8_contenders, lineup, measure, options, report, session, stats




# ----------------------------------------------------------------------------------------------------
# Inputs and helpers


def test_prompts_file_is_a_varied_dozen():
    prompts = session.load_prompts(options.PROMPTS)
    assert len(prompts) == 12
    assert len(set(prompts)) == 12
    assert any(len(p.split()) <= 3 for p in prompts), "expected a short prompt"
    assert any(len(p.split()) > 70 for p in prompts), "expected a long prompt (past CLIP's 77-token window)"
    assert sum(any(ord(ch) > 127 for ch in p) for p in prompts) >= 3, "expected several non-ASCII prompts"
    assert session.load_prompts(options.PROMPTS, 2) == prompts[:2]


def test_load_prompts_skips_comments_and_rejects_too_many(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("# comment\n\n  first  \nsecond\n", encoding="utf-8")
    assert session.load_prompts(path) == ["first", "second"]
    with pytest.raises(ValueError, match="num-prompts <= 2.*got 3"):
        session.load_prompts(path, 3)
    path.write_text("# only a comment\n", encoding="utf-8")
    with pytest.raises(ValueError, match="at least one prompt"):
        session.load_prompts(path)


def test_percentile_interpolates_between_order_statistics():
    assert stats.percentile([4.0, 1.0, 3.0, 2.0], 90) == pytest.approx(3.7)
    assert stats.percentile([5.0], 90) == 5.0
    values = list(np.random.default_rng(0).random(11))
    assert stats.percentile(values, 50) == pytest.approx(statistics.median(values))


def test_model_slug_and_gpu_label():
    assert session.model_slug("full-flux") == "full-flux"
    assert session.model_slug("/data/models/FLUX.1-dev") == "FLUX.1-dev"
    assert session.gpu_label(torch.device("cpu")) == "cpu"


def test_transformer_timer_counts_each_forward_and_detaches():
    module = torch.nn.Linear(8, 8)
    timer = measure.TransformerTimer(module, torch.device("cpu"))
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
        (["--rounds", "0"], "--rounds >= 1, got 0"),
        (["--repeats", "0"], "--repeats >= 1, got 0"),
        (["--rerender", "/nonexistent/e2e.json"], "/nonexistent/e2e.json"),
        (["--contenders", "diffusers,vllm"], "'diffusers,vllm'"),
        (["--prompts", "/nonexistent/prompts.txt"], "/nonexistent/prompts.txt"),
        (["--model", "no-such-model"], "no-such-model"),
        (["--num-prompts", "13"], "got 13"),
        (["--height", "100"], "height to be a positive multiple of 16 for tiny-flux, got 100"),
        (["--compile-also", "full"], "expected --compile with --compile-also 'full'"),
        (["--compile", "regional", "--compile-also", "full,turbo"], "got 'turbo'"),
        (["--compile", "regional", "--compile-also", "regional"], "other than --compile's 'regional'"),
        (["--compile", "regional", "--compile-also", "full,full"], "each --compile-also mode once"),
    ],
)
def test_bad_option_values_give_one_line_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("xstage-dit: error:") and "\n" not in err
    assert needle in err


def test_contenders_run_in_the_order_given_with_the_baseline_first():
    """A budget that runs out skips the last ones named: the rows a call is for go first."""
    assert options.parse_contenders("xstage-fp8-served, diffusers-fp8,diffusers,xstage-fp8-served") == [
        "diffusers", "xstage-fp8-served", "diffusers-fp8"]
    names = options.parse_contenders("xstage-fp8-attn,xstage-served,xstage-fp8")
    assert [c.family for c in lineup.make_contenders(names, with_compile=True, with_eager=False)
            if c.compile] == ["xstage-fp8-attn", "xstage-served", "xstage-fp8"]


def test_gpus_must_match_the_launched_ranks(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")  # as under torchrun --nproc-per-node 3
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--gpus", "2"])
    assert exc.value.code == 2
    assert "expected --gpus to equal the launched ranks (WORLD_SIZE=3), got --gpus 2" in capsys.readouterr().err


def test_the_harness_imports_no_cli_and_writes_below_the_current_directory():
    """bench sits below cli (its options are bench.options), and the default results folder is relative to
    the current directory, not the package's parent (which is site-packages in an installed wheel)."""
    import argparse
    import subprocess
    import sys

    probe = ("import sys, xstage_dit.bench.e2e, xstage_dit.bench.report; "
             "print(sorted(m for m in sys.modules if m.startswith('xstage_dit.cli')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    args = parser.parse_args(["--seed", "5", "--weights-seed", "9"])
    assert args.out_dir == "benchmarks/results" and (args.seed, args.weights_seed) == (5, 9)
    assert "--weights-seed 9" in options.command_line(args) and "--seed 5" in options.command_line(args)


def test_help_lists_every_contender(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = re.sub(r"-\n\s+", "-", capsys.readouterr().out)  # argparse wraps a long name after a hyphen
    for name in options.CONTENDERS:
        assert name in out
    assert "--compile" in out and "--time-budget-s" in out


# ----------------------------------------------------------------------------------------------------
# Results: summary, comparisons, run order, budget


def _ok(name, median, step_s=0.1, compile=False, latencies=None, family=None):
    family = family or name.replace("+compile", "")
    row = {"name": name, "family": family, "compile": compile, "status": "ok",
           "median_s": median, "p90_s": median, "transformer_step_ms": 1e3 * step_s, "warmup_s": 1.0}
    if latencies is not None:
        row["latencies_s"] = latencies
    return row


def test_summary_and_comparisons_are_the_measured_ratios():
    records = [
        _ok("diffusers", 2.0),
        _ok("xstage-serial", 1.6),
        _ok("xstage-calibrated", 1.25),
        _ok("diffusers+compile", 1.0, compile=True),
        _ok("xstage-serial+compile", 0.8, compile=True),
        _ok("xstage-serial+compile:full", 0.7, compile=True, family="xstage-serial"),
        _ok("xstage-calibrated+compile:full", 0.56, compile=True, family="xstage-calibrated"),
        {"name": "xfuser-usp", "family": "xfuser-usp", "compile": False, "status": "cannot run", "reason": "why"},
    ]
    stats.add_comparisons(records, default_steps=28, steps=4)
    summary = stats.build_summary(records, {"steps": 4})
    by = summary["contenders"]
    assert summary["baseline"] == "diffusers" and summary["measured_at_steps"] == 4
    assert by["diffusers"]["speedup_vs_diffusers_1gpu"] == pytest.approx(1.0)
    assert by["xstage-calibrated"] == {"status": "ok", "median_latency_s": 1.25, "speedup_vs_diffusers_1gpu": pytest.approx(1.6),
                                       "verdict": "not measured", "ratio_vs_diffusers": None, "ratio_ci95": None}
    assert by["xstage-serial+compile"]["speedup_vs_diffusers_1gpu"] == pytest.approx(2.5)
    assert by["xfuser-usp"] == {"status": "cannot run", "reason": "why"}
    rec = {r["name"]: r for r in records}
    assert rec["xstage-calibrated"]["speedup_vs_xstage_serial"] == pytest.approx(1.28)
    assert rec["xstage-serial+compile"]["speedup_vs_diffusers_same_compile"] == pytest.approx(1.25)
    # a --compile-also row compares with the same mode's rows only: no diffusers+compile:full was measured
    assert rec["xstage-calibrated+compile:full"]["speedup_vs_diffusers_same_compile"] is None
    assert rec["xstage-calibrated+compile:full"]["speedup_vs_xstage_serial"] == pytest.approx(1.25)
    assert "baseline_drift_pct" not in rec["diffusers"]  # no repeat measured: no drift
    assert "not_slower_than_diffusers" not in rec["xstage-serial"]  # no latencies to pair: no claim either way
    assert "verdict" not in rec["xstage-serial+compile"]  # verdicts are for the eager xstage rows
    # 24 missing steps at the measured 0.1 s/step, labelled as an extrapolation.
    assert rec["diffusers"]["latency_s_at_default_steps_extrapolated"] == pytest.approx(2.0 + 24 * 0.1)


def test_run_order_baseline_first_irreversible_last():
    order = [c.name for c in lineup.make_contenders(list(options.CONTENDERS), True, world_size=4)]
    assert order[0] == "diffusers"
    assert order[-6:] == ["xfuser-runner", "xfuser-runner+compile", "xfuser-usp", "xfuser-usp+compile",
                          "diffusers-cp", "diffusers-cp+compile"]  # the runner leaves our transformer as it was
    assert order[:21] == ["diffusers", "xstage-serial", "xstage-calibrated", "xstage-cfgbatch", "xstage-served",
                          "diffusers-fp8", "xstage-fp8", "xstage-fp8-served", "xstage-fp8-attn", "xstage-fp8-attn-served",
                          "diffusers-repeat", "diffusers+compile", "xstage-serial+compile", "xstage-calibrated+compile",
                          "xstage-cfgbatch+compile", "xstage-served+compile", "diffusers-fp8+compile",
                          "xstage-fp8+compile", "xstage-fp8-served+compile", "xstage-fp8-attn+compile",
                          "xstage-fp8-attn-served+compile"]
    order1 = [c.name for c in lineup.make_contenders(list(options.CONTENDERS), True, world_size=1)]
    assert order1[-6:] == ["xfuser-usp", "xfuser-runner", "xfuser-usp+compile", "xfuser-runner+compile",
                           "diffusers-cp", "diffusers-cp+compile"]
    assert len(order1) == len(set(order1)) == 27
    # Interleaved rounds replace the A/B/A repeat; the rest of the order stays.
    order_rounds = [c.name for c in lineup.make_contenders(list(options.CONTENDERS), True, world_size=1, rounds=2)]
    assert order_rounds == [n for n in order1 if n != "diffusers-repeat"]
    # No xstage contender, no repeat.
    assert [c.name for c in lineup.make_contenders(["diffusers", "xfuser-usp"], False)][:2] == ["diffusers", "diffusers+compile"]
    # --compile-also: the xstage contenders again in each further mode, after the --compile variants
    also = [c.name for c in lineup.make_contenders(["diffusers", "xstage-calibrated", "xstage-served"], True,
                                                       compile_also=("full", "graphs"))]
    assert also[also.index("xstage-served+compile") + 1:] == [
        "xstage-calibrated+compile:full", "xstage-served+compile:full",
        "xstage-calibrated+compile:graphs", "xstage-served+compile:graphs"]
    assert [c.name for c in lineup.make_contenders(["xstage-calibrated"], False, compile_also=("full",))] == [
        "xstage-calibrated", "xstage-calibrated+compile"]  # no compile requested: no further modes either
    skipped = lineup.make_contenders(["diffusers"], False)
    assert [c.info.get("skip_reason") for c in skipped] == [None, "torch.compile variants not requested (--compile)"]


class _Args:
    compile_estimate_s = 100.0
    compile = "regional"
    time_budget_s = 0.0
    repeats = 1


class _FakePipe:
    """Stands in for a pipeline: a transformer module called `steps` times per generation."""

    def __init__(self):
        self.transformer = torch.nn.Linear(4, 4)

    def __call__(self, num_inference_steps, **_):
        for _ in range(num_inference_steps):
            self.transformer(torch.randn(1, 4))
        return type("Out", (), {"images": np.zeros((1, 2, 2, 3), np.float32)})()


def _fake_bench(**over):
    class FakeBench(session.Bench):
        def call_kwargs(self, prompt, steps):
            return {"num_inference_steps": steps}

    args = _Args()
    args.warmup, args.warmup_steps = 1, 1
    fields = dict(args=args, spec=None, pipe=_FakePipe(), device=torch.device("cpu"), dtype=torch.float32,
                  rank=0, world_size=1, prompts=["a", "b", "c"], steps=3, height=8, width=8, frames=1,
                  t_start=0.0, build_s=7.0)
    fields.update(over)
    return FakeBench(**fields)


def test_fp8_contenders_cannot_run_on_a_cpu_and_say_why():
    from xstage_dit.families import model_spec

    b = _fake_bench(spec=model_spec("tiny-flux"))
    for contender in (fp8_contenders.PlainDiffusersFp8(False), fp8_contenders.XStageFp8(True),
                      fp8_contenders.XStageFp8Served(False, serve=lambda *a, **k: None),
                      fp8_contenders.XStageFp8Attention(True),
                      fp8_contenders.XStageFp8AttentionServed(False, serve=lambda *a, **k: None)):
        assert "FP8 row-wise GEMMs need a CUDA GPU" in contender.check(b) and "got device cpu" in contender.check(b)
    assert "fp8" not in ",".join(options.DEFAULT_CONTENDERS)  # asked for by name only


def test_fp8_ratios_in_the_summary_are_the_measured_medians():
    records = [_ok("xstage-served+compile", 4.0, compile=True, family="xstage-served"),
               _ok("xstage-calibrated+compile", 3.9, compile=True, family="xstage-calibrated"),
               _ok("diffusers-fp8+compile", 3.0, compile=True, family="diffusers-fp8"),
               _ok("xstage-fp8+compile", 2.6, compile=True, family="xstage-fp8"),
               _ok("xstage-fp8-served+compile", 2.7, compile=True, family="xstage-fp8-served"),
               _ok("xstage-fp8", 5.0, family="xstage-fp8"), _ok("xstage-calibrated", 6.0)]
    fp8 = stats.build_summary(records, {"steps": 4})["fp8"]
    assert fp8["+compile"] == {"fp8_over_bf16": pytest.approx(2.7 / 4.0), "fp8_over_peer_fp8": pytest.approx(2.7 / 3.0)}
    assert fp8["eager"] == {"fp8_over_bf16": pytest.approx(5.0 / 6.0), "fp8_over_peer_fp8": None}
    assert "fp8" not in stats.build_summary(records[:2], {"steps": 4})


def test_a_row_whose_output_went_nonfinite_is_left_out_of_the_fp8_ratios_and_named():
    peer = _ok("diffusers-fp8+compile", 2.5, compile=True, family="diffusers-fp8")
    peer["transformer_output_finite"] = False  # NaN operands run faster: its time is not comparable
    records = [_ok("xstage-served+compile", 4.0, compile=True, family="xstage-served"), peer,
               _ok("xstage-fp8-served+compile", 2.7, compile=True, family="xstage-fp8-served")]
    fp8 = stats.build_summary(records, {"steps": 4})["fp8"]["+compile"]
    assert fp8 == {"fp8_over_bf16": pytest.approx(2.7 / 4.0), "fp8_over_peer_fp8": None,
                   "nonfinite_rows": ["diffusers-fp8+compile"]}
    report.add_notes(records, {"default_steps": 4, "steps": 4})
    assert "NON-FINITE" in peer["note"] and "NON-FINITE" not in records[0]["note"]


def test_the_nonfinite_watch_sees_a_nan_output_and_only_that():
    from xstage_dit.bench.finite import NonFiniteWatch

    class Returns(torch.nn.Module):
        def forward(self, x):
            return (x * 2,)

    module = Returns()
    watch = NonFiniteWatch(module)
    module(torch.ones(3))
    assert not watch.seen()
    module(torch.tensor([1.0, float("nan")]))
    module(torch.ones(3))  # a later finite output does not clear it
    assert watch.seen()
    watch.reset()  # the warm-up's outputs are forgotten
    module(torch.ones(3))
    assert not watch.seen()
    watch.remove()
    assert not module._forward_hooks


def test_fp8_attention_rows_get_their_own_ratios():
    records = [_ok("xstage-served+compile", 4.0, compile=True, family="xstage-served"),
               _ok("diffusers-fp8+compile", 3.0, compile=True, family="diffusers-fp8"),
               _ok("xstage-fp8-served+compile", 2.7, compile=True, family="xstage-fp8-served"),
               _ok("xstage-fp8-attn-served+compile", 2.4, compile=True, family="xstage-fp8-attn-served"),
               _ok("xstage-fp8-attn", 4.5, family="xstage-fp8-attn"), _ok("xstage-calibrated", 6.0)]
    fp8 = stats.build_summary(records, {"steps": 4})["fp8"]
    assert fp8["+compile"] == {"fp8_over_bf16": pytest.approx(2.7 / 4.0), "fp8_over_peer_fp8": pytest.approx(2.7 / 3.0),
                               "fp8_attn_over_bf16": pytest.approx(2.4 / 4.0),
                               "fp8_attn_over_peer_fp8": pytest.approx(2.4 / 3.0),
                               "fp8_attn_over_fp8": pytest.approx(2.4 / 2.7)}
    # Only the FP8-attention row ran eager: its ratios, the linear-only ones None.
    assert fp8["eager"] == {"fp8_over_bf16": None, "fp8_over_peer_fp8": None,
                            "fp8_attn_over_bf16": pytest.approx(4.5 / 6.0), "fp8_attn_over_peer_fp8": None,
                            "fp8_attn_over_fp8": None}
    assert stats.SERVED_BARE_ROWS["xstage-fp8-attn-served"] == ("xstage-fp8-attn",)


def test_budget_estimate_uses_the_measured_baseline():
    b = _fake_bench()
    baseline = _ok("diffusers", 2.0)
    plain, compiled = contenders.PlainDiffusers(False), contenders.PlainDiffusers(True)
    assert measure.estimate_cost_s(b, plain, None) is None  # nothing measured yet: run it
    assert measure.estimate_cost_s(b, plain, baseline) == pytest.approx(1.0 + 3 * 2.0)
    assert measure.estimate_cost_s(b, compiled, baseline) == pytest.approx(1.0 + 3 * 2.0 + 100.0)
    # Warm-up and runs every round; the compile once.
    assert measure.estimate_cost_s(b, compiled, baseline, rounds=4) == pytest.approx(4 * (1.0 + 3 * 2.0) + 100.0)
    b.dirty = "xfuser-usp"  # a pristine pipeline has to be built again first
    assert measure.estimate_cost_s(b, plain, baseline) == pytest.approx(1.0 + 3 * 2.0 + 7.0)


def test_budget_uses_what_a_measured_row_of_the_same_kind_cost():
    b = _fake_bench(t_start=time.perf_counter())
    b.args.time_budget_s = 100.0  # seconds left: ~100

    class Runnable(fp8_contenders.XStageFp8Served):
        def check(self, bench):  # FP8 cannot run on this CPU: the budget is what is tested
            return None

    fp8 = Runnable(True, serve=lambda *a, **k: None)
    bf16 = contenders.PlainDiffusers(True)
    assert measure.precheck(b, fp8, None, []) == (None, None)  # nothing measured, no baseline: run it
    # the peer's compiled FP8 row: 20 s set-up, 232 s of warm-up (its compile), one 3 s run per prompt
    peer = dict(_ok("diffusers-fp8+compile", 3.0, compile=True), setup_s=20.0, warmup_s=232.0)
    status, reason = measure.precheck(b, fp8, None, [peer])
    assert status == "skipped" and reason.startswith("time budget (needs ~261 s, "), reason  # 20 + 232 + 3 x 3.0
    # a bf16 compiled row is not judged by an FP8 one's compile, nor an eager row by a compiled one
    assert measure.precheck(b, bf16, None, [peer]) == (None, None)
    assert measure.observed_cost_s(b, fp8_contenders.XStageFp8(False), [peer]) is None
    # once an xstage FP8 row is measured, xstage's are judged by it, not by the peer's tuned compile
    ours = dict(_ok("xstage-fp8-served+compile", 2.9, compile=True), setup_s=40.0, warmup_s=5.0)
    assert measure.observed_cost_s(b, fp8, [peer, ours]) == pytest.approx(40.0 + 5.0 + 3 * 2.9)
    assert measure.precheck(b, fp8, None, [peer, ours]) == (None, None)
    peer_again = fp8_contenders.PlainDiffusersFp8(True)
    assert measure.observed_cost_s(b, peer_again, [peer, ours]) == pytest.approx(261.0)


def test_measure_times_every_prompt_and_counts_forwards():
    b = _fake_bench()
    record, output = measure.measure(b, contenders.PlainDiffusers(False), None)
    assert record["status"] == "ok", record
    assert len(record["latencies_s"]) == 3 and record["median_s"] == statistics.median(record["latencies_s"])
    assert record["transformer_forwards_per_step"] == 1.0
    assert record["transformer_step_ms"] > 0
    assert output.shape == (2, 2, 3)


def test_measure_counts_the_frames_dynamo_converts_in_the_warm_up_and_in_the_timed_runs():
    b = _fake_bench()

    class Compiling(contenders.PlainDiffusers):
        def call(self, bench, kwargs):  # the warm-up's one step and the timed runs' three: two shapes
            fn(torch.ones(kwargs["num_inference_steps"]))
            return super().call(bench, kwargs)

    fn = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    record, _ = measure.measure(b, Compiling(False), None)
    assert record["status"] == "ok", record
    # a recompile inside the timing shows (the H100's FP8 rows: per-block graphs were found this way)
    assert (record["dynamo_frames_setup_warmup"], record["dynamo_frames_timed"]) == (1, 1)
    phases = record["compile_s_setup_warmup"]  # the eager backend: Dynamo's tracing, no AOTAutograd or Inductor
    assert set(phases) == {"total", "dynamo_tracing", "aot_autograd", "inductor", "triton_compile_wait"}
    assert phases["total"] >= phases["dynamo_tracing"] > 0 and phases["inductor"] == phases["aot_autograd"] == 0


def test_measure_records_the_timed_runs_gc_pauses_and_cudnn_fp8_bindings(monkeypatch):
    """What a host-bound row is read by: the collector's pauses inside the timed runs, and how cuDNN FP8
    attention bound its operands there (the warm-up's calls not counted)."""
    import gc
    import sys
    import types

    counts = {"uid": 0, "tensor": 0}
    monkeypatch.setitem(sys.modules, "xstage_dit.ops.attention.cudnn_fp8",
                        types.SimpleNamespace(pack_counts=lambda: dict(counts)))
    b = _fake_bench()

    class Attending(contenders.PlainDiffusers):
        def call(self, bench, kwargs):
            counts["tensor" if kwargs["num_inference_steps"] == 1 else "uid"] += 5
            gc.collect()
            return super().call(bench, kwargs)

    record, _ = measure.measure(b, Attending(False), None)
    assert record["status"] == "ok", record
    assert record["cudnn_fp8_calls_timed"] == {"uid": 15, "tensor": 0}  # three timed runs, five calls each
    assert record["gc_pause_s_timed"] > 0
    monkeypatch.delitem(sys.modules, "xstage_dit.ops.attention.cudnn_fp8")
    record, _ = measure.measure(b, contenders.PlainDiffusers(False), None)
    assert "cudnn_fp8_calls_timed" not in record and record["gc_pause_s_timed"] >= 0

    class AskingForFp8Attention(contenders.PlainDiffusers):  # asked for FP8 attention, made no call (NucleusMoE)
        fp8_attention = "auto"

    record, _ = measure.measure(b, AskingForFp8Attention(False), None)
    assert record["cudnn_fp8_calls_timed"] == {"uid": 0, "tensor": 0}


def test_repeats_time_each_prompt_back_to_back_and_cost_their_runs():
    b = _fake_bench(prompts=["a", "b"])
    b.args.repeats = 3
    seen = []

    class Recording(contenders.PlainDiffusers):
        def call(self, bench, kwargs):
            seen.append(kwargs["num_inference_steps"])
            return super().call(bench, kwargs)

    record, _ = measure.measure(b, Recording(False), None)
    assert record["status"] == "ok", record
    assert seen == [1] + [3] * 6  # the warm-up, then 2 prompts x 3 runs
    assert len(record["latencies_s"]) == len(record["transformer_step_ms_all"]) == 6
    assert measure.estimate_cost_s(b, contenders.PlainDiffusers(False), _ok("diffusers", 2.0)) == pytest.approx(
        1.0 + 2 * 3 * 2.0)


def test_measure_reports_a_failing_contender_and_undoes_it():
    events = []

    class Broken(contenders.Contender):
        family = "broken"

        def apply(self, b):
            events.append("apply")

        def call(self, b, kwargs):
            raise RuntimeError("boom at step 1")

        def restore(self, b):
            events.append("restore")

    b = _fake_bench()
    record, output = measure.measure(b, Broken(False), None)
    assert record["status"] == "failed" and "RuntimeError: boom at step 1" in record["reason"]
    assert events == ["apply", "restore"] and output is None
    assert b.pipe.transformer._forward_hooks == {}  # the timer's hooks are gone too


# ----------------------------------------------------------------------------------------------------
# End to end on the tiny FLUX pipeline (CPU)


def test_end_to_end_tiny_flux_writes_json_md_png(tmp_path, capsys):
    rc = cli.main([
        "bench", "--model", "tiny-flux", "--num-prompts", "1", "--steps", "2", "--out-dir", str(tmp_path),
        # Compile variants are requested but cannot fit the budget: reported as skipped, never omitted.
        "--compile", "--compile-estimate-s", "1e6", "--time-budget-s", "1e5", "--compile-also", "full",
    ])
    assert rc == 0
    stem = tmp_path / "e2e-tiny-flux-1xcpu"
    record = json.loads(stem.with_suffix(".json").read_text(encoding="utf-8"))
    rows = {r["name"]: r for r in record["rows"]}
    expected = ({n + s for n in options.DEFAULT_CONTENDERS for s in ("", "+compile")} | {"diffusers-repeat"}
                | {n + "+compile:full" for n in ("xstage-serial", "xstage-calibrated", "xstage-cfgbatch", "xstage-served")})
    assert set(rows) == expected
    malloc = record["summary"]["settings"]["malloc_keeps_freed_memory"]  # a served row: set before every row
    assert malloc["applied"] or "not glibc" in malloc["reason"], malloc

    base = rows["diffusers"]
    assert base["status"] == "ok"
    assert len(base["latencies_s"]) == 1 and base["median_s"] > 0
    assert 0 < base["transformer_step_ms"] / 1e3 < base["median_s"]
    assert base["transformer_forwards_per_step"] == 1.0  # FLUX.1-dev: guidance-distilled, one forward a step
    assert base["peak_memory_gib"] is None  # CPU
    # where the call's time goes: the text encoders, the transformer, the VAE decoder, and the rest, adding up
    for name in ("diffusers", "xstage-calibrated", "xstage-served"):
        row = rows[name]
        assert row["text_encode_ms"] >= 0 and row["vae_decode_ms"] > 0 and row["transformer_ms"] > 0, row
        parts = row["text_encode_ms"] + row["vae_decode_ms"] + row["transformer_ms"] + row["other_ms"]
        assert parts == pytest.approx(1e3 * row["median_s"], rel=1e-6), (name, parts, row["median_s"])
    assert base["text_encode_ms"] > 0  # plain diffusers encodes every prompt (xstage's prompt cache may not)

    for name, row in rows.items():
        assert row["status"] in ("ok", "cannot run", "skipped", "failed"), row
        if row["status"] != "ok":
            assert row["reason"], f"{name} has no reason"
        if name.endswith(("+compile", "+compile:full")):
            eager = rows[name.split("+compile")[0]]
            if eager["status"] == "cannot run":  # the same detected reason, before any budget question
                assert (row["status"], row["reason"]) == ("cannot run", eager["reason"])
            else:
                assert row["status"] == "skipped" and row["reason"].startswith("time budget"), row
    # diffusers' native context parallelism needs an accelerator (and refuses degree 1): detected, not assumed.
    assert rows["diffusers-cp"]["status"] == "cannot run"
    assert "needs an accelerator" in rows["diffusers-cp"]["reason"]
    assert rows["xfuser-usp"]["status"] == "cannot run"
    for name in ("xstage-serial", "xstage-calibrated", "xstage-served"):
        assert rows[name]["status"] == "ok", rows[name]
        # Same seed, same prompt, world 1, fp32: the same image as plain diffusers.
        # The served image comes back as a PNG: rounded to 1/255 once.
        assert rows[name]["output_max_abs_diff_vs_diffusers"] < (1e-3 if name != "xstage-served" else 1 / 255 + 1e-3)
        # One prompt, paired with the geometric mean of diffusers and diffusers-repeat around it: one pair,
        # no spread, so no verdict and no "not slower" claim (the GPU runs use rounds or several prompts).
        assert rows[name]["ratio_pairs"] == 1
        assert rows[name]["verdict"] == "one pair: no verdict"
        assert "not_slower_than_diffusers" not in rows[name]
        assert f"| {rows[name]['verdict']} (" in stem.with_suffix(".md").read_text(encoding="utf-8")
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
    assert (settings["seed"], settings["weights_seed"]) == (0, 0)  # sampling and weights seeds, apart
    assert settings["compile_also"] == ["full"] and "--compile-also full" in settings["command"]

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
    cp = contenders.DiffusersCP(False)
    if torch.accelerator.device_count() == 0:
        assert "needs an accelerator" in cp.check(b)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    assert "Linear ships no _cp_plan" in cp.check(b)
    b.pipe.transformer._cp_plan = {"": {}}
    reason = cp.check(b)  # world 1: diffusers itself refuses a Ulysses degree of 1
    assert "ContextParallelConfig(ulysses_degree=1) refuses" in reason and "greater than 1" in reason


def test_two_ranks_agree_and_rank0_writes(tmp_path):
    """2 CPU ranks (gloo), started by the benchmark itself (xstage_dit.comm.launcher): every rank takes the
    same decisions, rank 0 writes the files."""
    import os
    import subprocess
    import sys

    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    argv = ["--model", "tiny-flux", "--gpus", "2", "--device", "cpu", "--num-prompts", "1", "--steps", "1",
               "--warmup", "0", "--contenders", "diffusers,xstage-serial", "--out-dir", str(tmp_path)]
    cmd = [sys.executable, "-m", "xstage_dit.bench.e2e", *argv]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"e2e-tiny-flux-2xcpu.{s}" for s in ("json", "md", "png")]
    record = json.loads((tmp_path / "e2e-tiny-flux-2xcpu.json").read_text(encoding="utf-8"))
    assert record["summary"]["settings"]["gpus"] == record["summary"]["settings"]["world_size"] == 2
    rows = {r["name"]: r for r in record["rows"]}
    assert rows["diffusers"]["status"] == "ok"
    assert proc.stdout.count("[bench] diffusers: ok") == 1  # rank 0 reports, the other rank is silent
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
    assert rows["xstage-serial"]["status"] == "ok", rows["xstage-serial"]
    assert rows["xstage-serial"]["output_max_abs_diff_vs_diffusers"] < 0.2  # bf16: kernels may differ; garbage is ~0.5+


def test_measure_undoes_a_half_applied_contender():
    events = []

    class HalfApplied(contenders.Contender):
        family = "half"

        def apply(self, b):
            events.append("apply")
            raise ValueError("expected sp to divide 24 heads, got sp=5")

        def restore(self, b):
            events.append("restore")

    record, _ = measure.measure(_fake_bench(), HalfApplied(False), None)
    assert record["status"] == "failed" and "expected sp to divide 24 heads" in record["reason"]
    assert events == ["apply", "restore"]


def test_repeat_baseline_gives_the_drift_and_the_paired_verdict():
    records = [_ok("diffusers", 2.005, latencies=[2.00, 2.01]),
               _ok("xstage-serial", 2.0175, latencies=[2.015, 2.02]),
               _ok("xstage-calibrated", 2.405, latencies=[2.40, 2.41]),
               _ok("diffusers-repeat", 2.025, latencies=[2.02, 2.03]),
               _ok("xstage-serial+compile", 3.0, compile=True, latencies=[3.0, 3.0])]
    stats.add_comparisons(records, default_steps=4, steps=4)
    rec = {r["name"]: r for r in records}
    assert rec["diffusers"]["baseline_drift_pct"] == pytest.approx(100 * 0.02 / 2.005)
    serial, calibrated = rec["xstage-serial"], rec["xstage-calibrated"]
    # 2 prompts, each against the geometric mean of the diffusers run before and the repeat after.
    assert serial["ratio_pairs"] == 2
    assert serial["ratio_vs_diffusers"] == pytest.approx(
        math.prod([2.015 / math.sqrt(2.00 * 2.02), 2.02 / math.sqrt(2.01 * 2.03)]) ** 0.5)
    assert serial["verdict"] == "same within noise" and serial["not_slower_than_diffusers"] is True
    assert calibrated["verdict"] == "slower" and calibrated["not_slower_than_diffusers"] is False
    assert calibrated["ratio_ci95"][0] > 1
    assert "verdict" not in rec["xstage-serial+compile"] and "verdict" not in rec["diffusers"]
    summary = stats.build_summary(records, {"steps": 4})["contenders"]
    assert summary["xstage-calibrated"]["not_slower_than_diffusers"] is False
    assert summary["xstage-calibrated"]["verdict"] == "slower"
    assert summary["xstage-serial"]["ratio_ci95"] == serial["ratio_ci95"]
    assert summary["diffusers"]["baseline_drift_pct"] == pytest.approx(rec["diffusers"]["baseline_drift_pct"])
    # Derived fields are recomputed, never left stale: without the repeat, the pairs are with diffusers only.
    records = [r for r in records if r["name"] != "diffusers-repeat"]
    stats.add_comparisons(records, default_steps=4, steps=4)
    assert "baseline_drift_pct" not in records[0] and records[1]["ratio_pairs"] == 2
    assert records[1]["ratio_vs_diffusers"] == pytest.approx(math.sqrt(2.015 / 2.00 * 2.02 / 2.01))


def test_the_h200_flux_run_reads_same_within_noise():
    """FLUX on an H200: 5.041 / 5.064 / 5.050 s (diffusers, xstage-serial, diffusers-repeat) made the strict
    median rule say "slower" for 0.3%; the paired interval says the difference is noise."""
    records = [_ok("diffusers", 5.0412, latencies=[5.0418857421875, 5.04060400390625]),
               _ok("xstage-serial", 5.0642, latencies=[5.04188916015625, 5.08658544921875]),
               _ok("diffusers-repeat", 5.0498, latencies=[5.0382236328125, 5.0614443359375])]
    stats.add_comparisons(records, default_steps=28, steps=28)
    serial = records[1]
    assert serial["median_s"] > max(records[0]["median_s"], records[2]["median_s"])  # the old rule: "slower"
    assert serial["verdict"] == "same within noise" and serial["not_slower_than_diffusers"] is True
    lo, hi = serial["ratio_ci95"]
    assert lo < 1 < hi  # two pairs (two prompts against the bracketing baselines): a wide interval around 1
    assert report.verdict_cell(serial) == f"same within noise ({serial['ratio_vs_diffusers']:.3f}x, 95% CI {lo:.3f}-{hi:.3f})"


# ----------------------------------------------------------------------------------------------------
# The verdict's statistics


def test_t95_table():
    assert stats.t95(1) == pytest.approx(12.706)
    assert stats.t95(10) == pytest.approx(2.228)
    assert stats.t95(30) == pytest.approx(2.042)
    assert stats.t95(31) == stats.t95(1000) == 1.96
    assert all(a > b for a, b in zip(stats.T95_TWO_SIDED, stats.T95_TWO_SIDED[1:]))  # narrower with more df
    with pytest.raises(ValueError, match="df >= 1, got 0"):
        stats.t95(0)


def test_ratio_verdict_interval_by_hand():
    # logs 0 and ln 1.1: mean ln(1.1)/2, sd ln(1.1)/sqrt(2), se ln(1.1)/2, t(1) = 12.706.
    out = stats.ratio_verdict([1.0, 1.1])
    half = 12.706 * math.log(1.1) / 2
    assert out["ratio"] == pytest.approx(math.sqrt(1.1))
    assert out["ci95"] == pytest.approx([math.sqrt(1.1) * math.exp(-half), math.sqrt(1.1) * math.exp(half)])
    assert out["pairs"] == 2 and out["verdict"] == "same within noise"


def test_ratio_verdict_on_synthetic_pairs():
    rng = np.random.default_rng(0)

    def noise(n, sigma):  # n log-normal factors around 1
        return np.exp(rng.normal(0.0, sigma, n))

    slower = stats.ratio_verdict(list(1.10 * noise(8, 0.02)))
    assert slower["verdict"] == "slower" and slower["ci95"][0] > 1 and slower["ratio"] == pytest.approx(1.10, rel=0.03)
    faster = stats.ratio_verdict(list(0.80 * noise(8, 0.02)))
    assert faster["verdict"] == "faster" and faster["ci95"][1] < 1
    # Equal on average, +-15% per pair (the NucleusMoE spread): no verdict either way.
    spread = noise(8, 0.15)
    same = stats.ratio_verdict(list(spread / np.exp(np.log(spread).mean())))
    assert same["verdict"] == "same within noise" and same["ci95"][0] < 1 < same["ci95"][1]
    # Exactly equal latencies: a zero-width interval at 1, still "same".
    assert stats.ratio_verdict([1.0, 1.0, 1.0]) == {"ratio": 1.0, "ci95": [1.0, 1.0], "verdict": "same within noise",
                                                   "pairs": 3}
    # One pair: no interval and no verdict either way, however large the ratio.
    one = stats.ratio_verdict([1.5])
    assert one["ci95"] is None and one["verdict"] == "one pair: no verdict" and one["ratio"] == pytest.approx(1.5)
    assert report.verdict_cell({"verdict": one["verdict"], "ratio_vs_diffusers": 1.5, "ratio_ci95": None}) == \
        "one pair: no verdict (1.500x, one pair: no CI)"
    assert stats.ratio_verdict([]) == {"ratio": None, "ci95": None, "verdict": "not measured", "pairs": 0}
    with pytest.raises(ValueError, match="positive finite"):
        stats.ratio_verdict([1.0, 0.0])


def test_paired_ratios_pair_the_same_round_and_prompt():
    x = {"latencies_s": [1.0, 2.0, 3.0, 4.0]}  # 2 rounds x 2 prompts
    base = {"latencies_s": [2.0, 2.0, 4.0, 8.0]}
    assert stats.paired_ratios(x, [base]) == pytest.approx([0.5, 1.0, 0.75, 0.5])
    # A contender that left after round 1 pairs its round only; two baselines (an A/B/A bracket) give one pair per
    # sample, against their geometric mean.
    assert stats.paired_ratios({"latencies_s": [1.0, 2.0]}, [base, {"latencies_s": [1.0, 4.0]}]) == \
        pytest.approx([1.0 / 2**0.5, 2.0 / 8**0.5])
    assert stats.paired_ratios({"latencies_s": []}, [base]) == []


# ----------------------------------------------------------------------------------------------------
# Interleaved rounds


class _FakeXStage(contenders.Contender):
    """A reversible stand-in for an xstage contender on the fake pipeline; fails in the rounds listed."""

    def __init__(self, family="xstage-serial", fail_in_rounds=()):
        super().__init__(False)
        self.family = family
        self.fail_in_rounds = set(fail_in_rounds)
        self.applied = 0

    def apply(self, b):
        self.applied += 1
        if self.applied in self.fail_in_rounds:
            raise RuntimeError(f"boom in round {self.applied}")


def _settings(**over):
    settings = {"model": "fake", "kind": "image", "family": "flux", "gpus": 1, "world_size": 1, "height": 8,
                "width": 8, "frames": 1, "steps": 3, "default_steps": 3, "guidance": 1.0, "seed": 0,
                "dtype": "float32", "num_prompts": 1, "prompts": ["a"], "warmup": 1, "warmup_steps": 1,
                "command": "test", "rounds": 3, "rounds_completed": 0}
    settings.update(over)
    return settings


def _rounds_run(tmp_path, group, rounds, seconds_left):
    """measure_in_rounds on the fake pipeline (one prompt); ``seconds_left`` answers every budget question."""
    import types

    b = _fake_bench(prompts=["a"], spec=types.SimpleNamespace(steps=3))
    b.seconds_left = seconds_left
    rep = report.Report(b, _settings(rounds=rounds), {"git_commit": "test"}, tmp_path / "e2e-fake-1xcpu")
    baseline_row, reference = measure.measure_in_rounds(b, group, rounds, rep)
    return rep, baseline_row, reference


def test_rounds_rotate_and_a_failure_is_not_retried(tmp_path, capsys):
    failing_first = _FakeXStage("xstage-calibrated", fail_in_rounds={1})
    failing_later = _FakeXStage("xstage-serial", fail_in_rounds={2})
    group = [contenders.PlainDiffusers(False), failing_later, failing_first]
    report, baseline_row, reference = _rounds_run(tmp_path, group, 3, lambda: math.inf)
    rows = {r["name"]: r for r in report.rows}
    assert report.settings["rounds_completed"] == 3 and "rounds_stopped" not in report.settings
    base = rows["diffusers"]
    assert baseline_row is base and reference.shape == (2, 2, 3)
    assert base["rounds"] == 3 and len(base["latencies_s"]) == len(base["round_medians_s"]) == 3
    assert base["median_s"] == statistics.median(base["latencies_s"])
    assert "baseline_round_spread_pct" in base
    # Failed in round 1: a failed row, never applied again.
    assert rows["xstage-calibrated"]["status"] == "failed" and "boom in round 1" in rows["xstage-calibrated"]["reason"]
    assert failing_first.applied == 1
    # Failed in round 2: keeps round 1, says why it has no more, pairs its one round with diffusers' round 1.
    serial = rows["xstage-serial"]
    assert serial["status"] == "ok" and serial["rounds"] == 1 and failing_later.applied == 2
    assert serial["round_failure"].startswith("round 2: RuntimeError: boom in round 2")
    assert serial["ratio_pairs"] == 1 and serial["verdict"] != "slower"
    assert "no later rounds after round 2" in serial["note"]
    # Round r starts at offset r mod 3.
    running = [line.split(" (round")[0].removeprefix("[bench] ") for line in capsys.readouterr().out.splitlines()
               if line.endswith(": running")]
    assert running == ["diffusers", "xstage-serial", "xstage-calibrated", "xstage-serial", "diffusers", "diffusers"]
    written = json.loads((tmp_path / "e2e-fake-1xcpu.json").read_text(encoding="utf-8"))
    assert [r["name"] for r in written["rows"]] == ["diffusers", "xstage-serial", "xstage-calibrated"]


def test_rounds_stop_for_everyone_when_the_next_does_not_fit(tmp_path):
    answers = iter([math.inf, 1e6, 0.0])  # round 1's budget check of xstage, before round 2, before round 3
    group = [contenders.PlainDiffusers(False), _FakeXStage()]
    report, _, _ = _rounds_run(tmp_path, group, 4, lambda: next(answers))
    rows = {r["name"]: r for r in report.rows}
    assert report.settings["rounds_completed"] == 2
    assert report.settings["rounds_stopped"].startswith("time budget: round 3 needs ~")
    assert rows["diffusers"]["rounds"] == rows["xstage-serial"]["rounds"] == 2
    assert rows["xstage-serial"]["ratio_pairs"] == 2
    md = (tmp_path / "e2e-fake-1xcpu.md").read_text(encoding="utf-8")
    assert "ran in 2 interleaved rounds (4 requested, stopped by the time budget: round 3" in md


def test_a_first_round_that_does_not_fit_is_skipped(tmp_path):
    group = [contenders.PlainDiffusers(False), _FakeXStage()]
    report, _, _ = _rounds_run(tmp_path, group, 2, lambda: 0.0)
    rows = {r["name"]: r for r in report.rows}
    assert rows["diffusers"]["status"] == "ok"  # the baseline is never skipped for time
    assert rows["xstage-serial"]["status"] == "skipped" and rows["xstage-serial"]["reason"].startswith("time budget")
    assert report.settings["rounds_completed"] == 1  # round 2 of the baseline alone did not fit either


# ----------------------------------------------------------------------------------------------------
# End to end in rounds, and --rerender (one tiny run shared by both)


@pytest.fixture(scope="module")
def rounds_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("rounds")
    import contextlib
    import io

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = cli.main(["bench", "--model", "tiny-flux", "--num-prompts", "1", "--steps", "1", "--rounds", "2",
                       "--contenders", "diffusers,xstage-serial,xstage-calibrated", "--out-dir", str(out)])
    assert rc == 0, stdout.getvalue()[-3000:]
    return out / "e2e-tiny-flux-1xcpu.json", stdout.getvalue()


def test_rounds_end_to_end_tiny_flux(rounds_run):
    path, stdout = rounds_run
    record = json.loads(path.read_text(encoding="utf-8"))
    rows = {r["name"]: r for r in record["rows"]}
    assert "diffusers-repeat" not in rows  # the rounds interleave instead of A/B/A
    settings = record["summary"]["settings"]
    assert (settings["rounds"], settings["rounds_completed"]) == (2, 2)
    base = rows["diffusers"]
    assert base["status"] == "ok" and base["rounds"] == 2
    assert len(base["latencies_s"]) == 2 * 1 and len(base["round_medians_s"]) == 2
    assert base["round_medians_s"] == base["latencies_s"]  # one prompt: a round's median is its one run
    assert "baseline_round_spread_pct" in base and "baseline_drift_pct" not in base
    assert "output_max_abs_diff_vs_diffusers" not in base  # the reference itself
    assert "[bench] xstage-serial (round 2/2): running" in stdout
    for name in ("xstage-serial", "xstage-calibrated"):
        row = rows[name]
        assert row["status"] == "ok" and row["rounds"] == 2 and len(row["latencies_s"]) == 2, row
        assert row["ratio_pairs"] == 2 and row["verdict"] in ("slower", "faster", "same within noise")
        assert len(row["ratio_ci95"]) == 2 and row["not_slower_than_diffusers"] == (row["verdict"] != "slower")
        assert record["summary"]["contenders"][name]["verdict"] == row["verdict"]
        assert row["output_max_abs_diff_vs_diffusers"] < 1e-3
    md = path.with_suffix(".md").read_text(encoding="utf-8")
    assert "| verdict |" in md and "ran in 2 interleaved rounds (2 requested)" in md


def test_rerender_recomputes_without_measuring(rounds_run, tmp_path, capsys):
    source, _ = rounds_run
    path = tmp_path / source.name
    record = json.loads(source.read_text(encoding="utf-8"))
    measured = {r["name"]: (r.get("median_s"), r.get("latencies_s"), r.get("round_medians_s")) for r in record["rows"]}
    # What an older version wrote: the strict rule's field, no verdicts; and provenance of its own.
    for row in record["rows"]:
        for key in ("verdict", "ratio_vs_diffusers", "ratio_ci95", "ratio_pairs"):
            row.pop(key, None)
        if row["name"].startswith("xstage"):
            row["not_slower_than_diffusers"] = "stale"
    record["provenance"] = {"measured": "on the device"}
    path.write_text(json.dumps(record), encoding="utf-8")

    assert cli.main(["bench", "--rerender", str(path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [source.stem + s for s in (".json", ".md", ".png")]
    new = json.loads(path.read_text(encoding="utf-8"))
    assert {r["name"]: (r.get("median_s"), r.get("latencies_s"), r.get("round_medians_s")) for r in new["rows"]} == measured
    assert new["environment"] == record["environment"] and new["summary"]["settings"] == record["summary"]["settings"]
    assert new["provenance"]["measured"] == "on the device"
    rerendered = new["provenance"]["rerendered"]
    assert rerendered["at_commit"] and rerendered["what"] == "comparisons and verdicts recomputed from the measured latencies"
    serial = next(r for r in new["rows"] if r["name"] == "xstage-serial")
    assert serial["not_slower_than_diffusers"] is (serial["verdict"] != "slower") and serial["ratio_pairs"] == 2
    assert "rewrote" in capsys.readouterr().out


def test_rerender_refuses_other_json(tmp_path, capsys):
    path = tmp_path / "flux-step.json"
    path.write_text(json.dumps({"benchmark": "flux-step", "rows": []}), encoding="utf-8")
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--rerender", str(path)])
    assert exc.value.code == 2
    assert "expected --rerender to be a results JSON written by xstage-dit bench" in capsys.readouterr().err


def test_served_video_is_timed_through_the_job_api(tmp_path):
    """tiny-wan through POST /v1/videos: the served row runs, records where its time went, and its frames
    (decoded from the MP4 after the stopwatch) are the bare call's within the codec's error."""
    rc = cli.main(["bench", "--model", "tiny-wan", "--num-prompts", "1", "--steps", "2", "--out-dir", str(tmp_path),
                   "--contenders", "diffusers,xstage-calibrated,xstage-served"])
    assert rc == 0
    record = json.loads((tmp_path / "e2e-tiny-wan-1xcpu.json").read_text(encoding="utf-8"))
    rows = {r["name"]: r for r in record["rows"]}
    served = rows["xstage-served"]
    assert served["status"] == "ok", served
    timings = served["served_timings"]
    assert timings and all(t["bytes"] > 0 and t["pipeline_s"] > 0 and t["encode_s"] > 0 for t in timings), timings
    assert all(t["client_s"] >= t["total_s"] for t in timings), timings
    # H.264 (yuv420p) is lossy: the served frames differ from the bare ones by the codec, never wildly.
    assert served["output_max_abs_diff_vs_diffusers"] < 0.5


def test_the_report_says_how_often_each_prompt_was_timed():
    assert report._repeats({"repeats": 5}) == ", each timed 5 times in a row"
    assert report._repeats({"repeats": 1}) == report._repeats({}) == ""  # older results: no such key


def test_served_rows_are_paired_with_the_bare_row_of_their_configuration():
    """Issue 15's served / bare: each served sample over the bare sample of the same round, prompt and repeat
    (xstage-calibrated, else xstage-serial; the same compile setting), as a geometric mean with its interval,
    in the row, its note and the summary; recomputed, never stale."""
    bare, served = [0.573, 0.5725, 0.5741], [0.5802, 0.5787, 0.579]
    records = [_ok("diffusers", 0.7, latencies=[0.7, 0.7, 0.7]),
               _ok("xstage-serial", 0.9, latencies=[0.9, 0.9, 0.9]),
               _ok("xstage-calibrated", 0.573, latencies=bare),
               _ok("xstage-served", 0.579, latencies=served),
               _ok("xstage-serial+compile", 0.40, compile=True, latencies=[0.40]),
               _ok("xstage-served+compile", 0.41, compile=True, latencies=[0.41], family="xstage-served")]
    stats.add_comparisons(records, default_steps=4, steps=4)
    rec = {r["name"]: r for r in records}
    eager, compiled = rec["xstage-served"], rec["xstage-served+compile"]
    assert eager["served_bare_row"] == "xstage-calibrated" and eager["served_over_bare_pairs"] == 3
    assert eager["served_over_bare"] == pytest.approx(math.prod(s / b for s, b in zip(served, bare)) ** (1 / 3))
    lo, hi = eager["served_over_bare_ci95"]
    assert 1 < lo < eager["served_over_bare"] < hi < 1.02
    # no xstage-calibrated+compile row: the compiled served row pairs with the serial one; one pair, no interval
    assert compiled["served_bare_row"] == "xstage-serial+compile" and compiled["served_over_bare_ci95"] is None
    assert compiled["served_over_bare"] == pytest.approx(0.41 / 0.40)
    assert "served_over_bare" not in rec["xstage-calibrated"]
    report.add_notes(records, {"default_steps": 4})
    assert f"served / bare {eager['served_over_bare']:.3f}x (95% CI {lo:.3f}-{hi:.3f}, 3 pair(s) with " \
           "xstage-calibrated): within 1.02" in eager["note"]
    assert "served / bare 1.025x (1 pair(s) with xstage-serial+compile): over 1.02" in compiled["note"]
    summary = stats.build_summary(records, {"steps": 4})["contenders"]
    assert summary["xstage-served"]["served_over_bare_ci95"] == [lo, hi]
    # without its bare rows, a served row has no such field (not a stale one)
    records = [r for r in records if not r["name"].startswith(("xstage-calibrated", "xstage-serial"))]
    stats.add_comparisons(records, default_steps=4, steps=4)
    assert all("served_over_bare" not in r for r in records)


def test_compiled_only_lists_the_eager_variants_as_skipped_and_needs_compile():
    names = ["diffusers", "xstage-fp8-served", "diffusers-fp8"]
    made = lineup.make_contenders(names, True, with_eager=False)
    assert [c.name for c in made] == ["diffusers", "xstage-fp8-served", "diffusers-fp8", "diffusers+compile",
                                      "xstage-fp8-served+compile", "diffusers-fp8+compile"]  # no diffusers-repeat
    assert all(("skip_reason" in c.info) != c.compile for c in made), [(c.name, c.info) for c in made]
    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    with pytest.raises(UsageError, match="expected --compile with --compiled-only"):
        options.validate(parser.parse_args(["--compiled-only"]))
    options.validate(parser.parse_args(["--compiled-only", "--compile"]))


def test_the_peer_fp8_recipe_converts_every_linear_and_its_undo_gives_the_bf16_weights_back(monkeypatch):
    """`peer_fp8` (the diffusers-fp8 contender's recipe, also bench_compile_variants' @none+fp8) on tiny FLUX's
    transformer on the CPU, and the Inductor tuning torchao's defaults turn on for the process put back by the undo.
    torchao refuses row-wise FP8 off a GPU at quantize time; its two hardware checks are lifted here (torchao
    0.18.0, the pin) since what is tested is which layers convert and the undo, not a GEMM."""
    import torchao.quantization.quant_api as quant_api

    from xstage_dit.families.flux import build_transformer

    monkeypatch.setattr(quant_api, "is_sm_at_least_89", lambda: True)
    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)
    transformer = build_transformer("tiny", dtype=torch.bfloat16, device="cpu")
    linears = {name: m for name, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    before = {name: m.weight.detach().clone() for name, m in linears.items()}
    import torch._inductor.config as inductor_config

    config_before = inductor_config.get_config_copy()
    undo = fp8_contenders.peer_fp8(transformer)
    assert all(type(m.weight).__name__ == "Float8Tensor" for m in linears.values())  # every linear, no exclusions
    assert inductor_config.coordinate_descent_tuning and not config_before["coordinate_descent_tuning"]  # torchao's
    # A row of zeros (Wan's padded text) stays finite: torchao's default scale would quantize it to 0/0.
    layer = next(iter(linears.values()))
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)
    x[1] = 0
    with torch.inference_mode():
        out = layer(x)
    assert bool(torch.isfinite(out).all()), out
    assert torch.equal(out[1], layer.bias.expand_as(out[1]) if layer.bias is not None else torch.zeros_like(out[1]))
    undo()
    # rows measured after the peer compile as they would alone
    assert inductor_config.get_config_copy() == config_before
    for name, m in linears.items():
        assert type(m.weight) is torch.nn.Parameter and m.weight.dtype == torch.bfloat16, name
        assert torch.equal(m.weight, before[name]), name


def test_the_compiled_diffusers_rows_take_the_nucleusmoe_compile_fix_and_say_so(monkeypatch):
    # Plain diffusers' NucleusMoE fails torch.compile (features.compile_fixes); its compiled baselines, the peers'
    # FP8 row included, take the one-function fix and name it; eager rows and restore leave diffusers' own method.
    moe = pytest.importorskip("diffusers.models.transformers.transformer_nucleusmoe_image")
    layer = moe.NucleusMoELayer(hidden_size=64, moe_intermediate_dim=32, num_experts=4, capacity_factor=1.0,
                                use_sigmoid=False, route_scale=2.5, use_grouped_mm=True)
    b = _fake_bench()
    b.pipe.transformer = torch.nn.Sequential(layer)
    monkeypatch.setattr(type(b), "compile_transformer", lambda self, **kw: "regional: 1 block", raising=False)
    monkeypatch.setattr(type(b), "uncompile", lambda self: None, raising=False)
    eager = contenders.PlainDiffusers(False)
    eager.apply(b)
    assert "_run_experts_grouped_mm" not in vars(layer.experts) and "compile_fix" not in eager.info
    assert issubclass(fp8_contenders.PlainDiffusersFp8, contenders.PlainDiffusers)  # the peers' FP8 row too
    for compiled in (contenders.PlainDiffusers(True), contenders.PlainDiffusersRepeat(True)):
        compiled.apply(b)
        assert "_run_experts_grouped_mm" in vars(layer.experts)
        assert compiled.info["compile_mode"] == "regional: 1 block; " + compiled.info["compile_fix"]
        assert "fixed in 1 SwiGLUExperts" in compiled.info["compile_fix"]
        compiled.restore(b)
        assert "_run_experts_grouped_mm" not in vars(layer.experts)
    plain = contenders.PlainDiffusers(True)  # no MoE layer: nothing fixed, nothing said
    b.pipe.transformer = torch.nn.Linear(4, 4)
    plain.apply(b)
    assert plain.info == {"compile_mode": "regional: 1 block"}


def test_the_peer_fp8_recipe_and_our_feature_leave_the_layers_torch_refuses_in_bf16(monkeypatch):
    """NucleusMoE's timestep embedder's second layer (one row, 8192 -> 2048 at full size) made torch's row-wise
    FP8 GEMM raise CUBLAS_STATUS_NOT_SUPPORTED on the H100 in both recipes: the family record names it, the peers'
    recipe and our row-wise feature keep it in bf16 (ours says why), every other eligible linear converts; tensor-wise
    FP8 is not row-wise and keeps nothing for it."""
    import torchao.quantization.quant_api as quant_api

    from xstage_dit.families.nucleusmoe import build_transformer
    from xstage_dit.features.fp8 import fp8_layers

    monkeypatch.setattr(quant_api, "is_sm_at_least_89", lambda: True)
    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)
    transformer = build_transformer("tiny", dtype=torch.bfloat16, device="cpu")
    refused = "time_text_embed.timestep_embedder.linear_2"
    assert fp8_contenders.peer_refused_layers(transformer) == [refused]
    chosen, kept = fp8_layers(transformer, "row")
    assert refused not in [p for p, _ in chosen]
    assert dict(kept)[refused].startswith("torch's row-wise FP8 GEMM refuses it")
    assert refused in [p for p, _ in fp8_layers(transformer, "tensor")[0]]
    linears = {name: m for name, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    undo = fp8_contenders.peer_fp8(transformer)
    converted = {name for name, m in linears.items() if type(m.weight).__name__ == "Float8Tensor"}
    undo()
    takes = {name for name, m in linears.items() if m.in_features % 16 == 0 and m.out_features % 16 == 0}
    assert converted == takes - {refused}  # torchao leaves the tiny router (4 experts wide) on its own
