"""The attention-kernel choice (schedule) and the kernel sweep's cache (calibration), on the CPU with fake timings."""

from __future__ import annotations

import json

import pytest

from xstage_dit.calibration import kernel_sweep as ks
from xstage_dit.schedule.attention_kernel import choose_attention_kernel, shape_family


def test_shape_family_buckets_and_padding():
    f = shape_family(batch=1, seq_len=4608, heads_local=3, head_dim=128, world_size=8, dtype_name="bfloat16")
    assert f == "bfloat16-d128-b1-s8192-hr3-p8"
    assert shape_family(batch=1, seq_len=4096, heads_local=3, head_dim=128, world_size=8,
                        dtype_name="bfloat16").endswith("s4096-hr3-p8")
    assert shape_family(batch=2, seq_len=4607, heads_local=4, head_dim=64, world_size=8,
                        dtype_name="float16") == "float16-d64-b2-s8192-hr4-p8-pad"
    assert "s1024" in shape_family(batch=1, seq_len=1, heads_local=1, head_dim=64, world_size=1, dtype_name="x")
    with pytest.raises(ValueError, match="seq_len"):
        shape_family(batch=1, seq_len=0, heads_local=1, head_dim=64, world_size=1, dtype_name="x")


def test_choice_takes_the_fastest_kernel_that_takes_the_shape():
    refusals = {"fa4": None, "cudnn": None, "triton": None}
    c = choose_attention_kernel({"fa4": 0.158, "cudnn": 0.106, "triton": 0.118}, refusals)
    assert c.name == "cudnn" and "cudnn 0.106" in c.reason and "fa4 0.158" in c.reason
    # A refusing kernel is never chosen, however fast its (stale) timing.
    c = choose_attention_kernel({"fa4": 0.158, "cudnn": 0.106, "triton": 0.118},
                                {"fa4": None, "cudnn": "writes padding rows", "triton": None})
    assert c.name == "triton" and c.refused == {"cudnn": "writes padding rows"}
    # Failed (None) or non-finite timings do not count; an unmeasured taker is named in the reason.
    c = choose_attention_kernel({"fa4": None, "cudnn": float("nan"), "triton": 1.0}, refusals)
    assert c.name == "triton" and "not measured: fa4, cudnn" in c.reason


def test_choice_without_measurements_and_when_all_refuse():
    c = choose_attention_kernel(None, {"fa4": "missing", "cudnn": None, "triton": None})
    assert c.name == "cudnn" and "not measured" in c.reason
    c = choose_attention_kernel({}, {"fa4": "no", "cudnn": "no", "triton": "fp32"})
    assert c.name is None and "serial path" in c.reason and "triton: fp32" in c.reason
    assert c.describe()["kernel"] is None


def test_a_baseline_is_kept_unless_another_kernel_measured_faster():
    from xstage_dit.schedule.attention_kernel import WORLD1_ORDER

    both = {"sdpa": None, "fa4": None}
    c = choose_attention_kernel({"sdpa": 9.0, "fa4": 8.0}, both, WORLD1_ORDER, baseline="sdpa")
    assert c.name == "fa4" and c.over_baseline == pytest.approx(9.0 / 8.0) and c.describe()["baseline_ms"] == 9.0
    c = choose_attention_kernel({"sdpa": 7.0, "fa4": 8.0}, both, WORLD1_ORDER, baseline="sdpa")
    assert c.name == "sdpa" and c.over_baseline == pytest.approx(1.0)
    # Without the baseline's own time nothing was shown faster: however fast FA4 alone measured.
    c = choose_attention_kernel({"fa4": 0.1}, both, WORLD1_ORDER, baseline="sdpa")
    assert c.name == "sdpa" and "sdpa not measured" in c.reason and c.over_baseline is None
    with pytest.raises(ValueError, match="expected the baseline 'sdpa' among the kernels offered"):
        choose_attention_kernel({}, {"fa4": None}, baseline="sdpa")
    # Without a baseline among the takers (world > 1) torch SDPA's time is only the reference.
    c = choose_attention_kernel({"sdpa": 1.0, "fa4": 0.8, "triton": 1.2}, {"fa4": None, "triton": None})
    assert c.name == "fa4" and c.baseline_ms == 1.0 and "sdpa" not in c.timings_ms and "torch SDPA" in c.reason


def test_run_sweep_interleaves_and_records_failures():
    calls = []

    def make(name, fail=False):
        def fn():
            calls.append(name)
            if fail:
                raise RuntimeError("no")
        return fn

    times = {"a": 2.0, "b": 1.0}
    timings, errors = ks.run_sweep({"fam": {"a": make("a"), "b": make("b"), "c": make("c", True)}},
                                   lambda fn: (fn(), times.get(calls[-1], 0.0))[1], rounds=3)
    assert timings == {"fam": {"a": 2.0, "b": 1.0, "c": None}}
    assert "RuntimeError: no" in errors["fam"]["c"]
    # Forward, then backward, then forward: a drift does not favour one kernel; a failed kernel is dropped.
    assert calls == ["a", "b", "c", "b", "a", "a", "b"]


def test_cache_roundtrip_and_key_mismatch(tmp_path):
    key = ks.sweep_key("NVIDIA H200", {"torch": "2.11", "flash_attn_4": "4.0.0b36"})
    measured = []

    def fa4():
        return None

    def triton():
        return None

    def make_cases(families):
        measured.extend(families)
        return {f: {"fa4": fa4, "triton": triton} for f in families}

    samples = {fa4: iter([1.0, 1.3, 1.1]), triton: iter([2.0, 2.1, 2.2])}
    sweep = ks.load_or_sweep(key, make_cases, ["f1"], lambda fn: next(samples[fn]), cache_dir=tmp_path, rounds=3)
    assert sweep.source == "measured" and measured == ["f1"]
    assert sweep.timings_ms["f1"] == {"fa4": pytest.approx(1.1), "triton": pytest.approx(2.1)}
    again = ks.load_or_sweep(key, make_cases, ["f1"], lambda fn: 99.0, cache_dir=tmp_path)
    assert again.source == "cache" and again.timings_ms == sweep.timings_ms and measured == ["f1"]
    # A new family is measured and merged; the old one is kept.
    more = ks.load_or_sweep(key, make_cases, ["f1", "f2"], lambda fn: 5.0, cache_dir=tmp_path)
    assert measured == ["f1", "f2"] and set(more.timings_ms) == {"f1", "f2"}
    # Another library version is another key: a miss.
    other = dict(key, versions={"torch": "2.12", "flash_attn_4": "4.0.0b36"})
    assert ks.load(other, tmp_path) is None
    data = json.loads(ks.cache_path(key, tmp_path).read_text())
    assert data["key"] == key and "f2" in data["timings_ms"]
