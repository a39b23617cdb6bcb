"""`benchmarks/bench_compile_variants.py`: its variant names (the Inductor options, FP8 and schedule each one
means) and a CPU run of tiny FLUX that records what each first call compiled."""

from __future__ import annotations

import re

import pytest

from benchmarks.bench_compile_variants import GEMM_TUNED, GRAPHS, MULTI_KERNEL, TUNED, Variant, file_part, parse_variant


def test_variant_names_give_their_mode_options_and_schedule():
    assert parse_variant("eager") == Variant("eager", None, False, "serial")
    assert parse_variant("regional+qkv@auto") == Variant("regional", None, True, "auto")
    assert parse_variant("full+graphs") == Variant("full", {"triton.cudagraphs": True}, False, "serial")
    assert parse_variant("full+tuned+graphs@none") == Variant("full", {**TUNED, **GRAPHS}, False, "none")
    assert parse_variant("regional+fp8t") == Variant("regional", fp8="tensor")
    assert parse_variant("regional+gemmtuned+fp8") == Variant("regional", GEMM_TUNED, fp8="row")
    assert parse_variant("regional+multikernel+fp8") == Variant("regional", MULTI_KERNEL, fp8="row")
    assert parse_variant("regional+fp8u") == Variant("regional", fp8="row", fp8_fuse=False)
    assert parse_variant("regional+fp8x") == Variant("regional", fp8="row", fp8_experts=False)
    assert file_part("regional+fp8+cudnnfp8@auto") == "regional_fp8_cudnnfp8_auto"
    assert GEMM_TUNED["max_autotune_gemm"] and "ATEN" in GEMM_TUNED["max_autotune_gemm_backends"]
    assert parse_variant("regional+fp8@none") == Variant("regional", schedule="none", fp8="row")
    assert parse_variant("regional+fp8+fp8attn@auto") == Variant("regional", schedule="auto", fp8="row",
                                                                  fp8_attention="auto")
    assert parse_variant("regional+fp8+cudnnfp8@auto") == Variant("regional", schedule="auto", fp8="row",
                                                                   fp8_attention="cudnn-fp8")


@pytest.mark.parametrize("bad", ["eager+graphs", "eager+tuned", "eager+gemmtuned", "eager+multikernel", "full+fast",
                                 "regional@fastest", "max",
                                 "regional+fp8+fp8t", "regional+fp8+fp8attn", "regional+fp8attn@auto",
                                 "regional+fp8w+fp8attn@auto", "regional+fp8t@none", "regional+fp8+cudnnfp8",
                                 "regional+fp8+fp8attn+cudnnfp8@auto", "regional+graphs+fp8",
                                 "regional+fp8u@none", "regional+fp8+fp8u", "regional+fp8x@none",
                                 "regional+fp8+fp8x"])
def test_a_bad_variant_is_named(bad):
    """Each malformed name raises, quoting it."""
    with pytest.raises(ValueError, match=re.escape(f"got {bad!r}")):
        parse_variant(bad)


def test_a_cpu_run_records_each_first_calls_frames_and_compile_phases(tmp_path):
    """Tiny FLUX on the CPU: bf16 eager and regional, then row-wise FP8 (no FP8 GEMM on a CPU: its row says why, and
    the run goes on) and weight-only FP8 (the granularity a CPU runs) regional; each measured row says how many
    frames its first call converted and how long each compile phase took."""
    import json

    from benchmarks.bench_compile_variants import main

    assert main(["--model", "flux", "--size", "tiny", "--device", "cpu", "--dtype", "bfloat16", "--height", "64",
                 "--width", "64", "--variants", "eager,regional,regional+fp8,regional+fp8w", "--backend", "eager",
                 "--warmup", "0", "--reps", "2", "--out-dir", str(tmp_path)]) == 0
    rows = {r["variant"]: r for r in json.loads((tmp_path / "compile-variants-flux.json").read_text())["rows"]}
    assert list(rows) == ["eager", "regional", "regional+fp8", "regional+fp8w"]
    assert "median_ms" not in rows["regional+fp8"] and "need a CUDA GPU" in rows["regional+fp8"]["note"], rows
    assert rows["eager"]["frames"] == 0 and rows["eager"]["compile_s"] == 0
    for name in ("regional", "regional+fp8w"):  # one graph per block class (FLUX: double and single blocks)
        assert 2 <= rows[name]["frames"] <= 4 and rows[name]["compile_phases"]["dynamo_tracing"] > 0, rows[name]
    assert rows["regional"]["max_abs_diff_vs_eager"] == 0  # the eager backend runs the same ops
    assert 0 < rows["regional+fp8w"]["max_abs_diff_vs_eager"] < 1  # float8 weights: close, not equal


def test_nucleusmoe_runs_as_the_served_call_batches_it(tmp_path, monkeypatch):
    """Tiny NucleusMoE on the CPU (bf16: the grouped GEMM's CPU dtype), eager and regional: one forward on CFG's pair
    as one batch of 2 (the served default), with the e2e call's text length; the compiled row equals the eager one."""
    import json

    import benchmarks.bench_compile_variants as cv

    seen = []
    real = cv._nucleusmoe_and_inputs
    monkeypatch.setattr(cv, "_nucleusmoe_and_inputs", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    assert cv.main(["--model", "nucleusmoe", "--size", "tiny", "--device", "cpu", "--dtype", "bfloat16",
                    "--height", "64", "--width", "64", "--variants", "eager,regional", "--backend", "eager",
                    "--warmup", "0", "--reps", "1", "--out-dir", str(tmp_path)]) == 0
    (_, inputs), = seen
    assert inputs["hidden_states"].shape[:2] == (2, 16) and inputs["img_shapes"] == [(1, 4, 4)] * 2
    assert inputs["encoder_hidden_states"].shape[:2] == (2, cv.NUCLEUS_TEXT)
    rows = {r["variant"]: r for r in json.loads((tmp_path / "compile-variants-nucleusmoe.json").read_text())["rows"]}
    assert rows["eager"]["median_ms"] > 0 and rows["regional"]["frames"] >= 1, rows
    assert rows["regional"]["max_abs_diff_vs_eager"] == 0  # the eager backend runs the same ops


def test_profile_first_call_names_where_the_first_call_spends_its_time(tmp_path):
    """--profile-first-call on the CPU (tiny FLUX, regional on the eager backend): the row keeps the first call's own
    time by package, Dynamo's share among them, and its costliest functions; the full listing is written beside."""
    import json

    from benchmarks.bench_compile_variants import main

    assert main(["--model", "flux", "--size", "tiny", "--device", "cpu", "--dtype", "float32", "--height", "64",
                 "--width", "64", "--variants", "regional", "--backend", "eager", "--warmup", "0", "--reps", "1",
                 "--profile-first-call", "--out-dir", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "compile-variants-flux.json").read_text())["rows"]
    profile = row["first_call_profile"]
    assert profile["by_package_s"]["torch._dynamo"] > 0, profile
    assert sum(profile["by_package_s"].values()) <= row["first_call_s"] + 0.5
    assert len(profile["top_cumulative"]) == 12 and all(s >= 0 for _, s in profile["top_cumulative"])
    listing = (tmp_path / "first-call-regional.txt").read_text()
    assert "cumulative" in listing and "tottime" in listing and "function calls" in listing


@pytest.mark.parametrize("name, kind", [
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<float_e4m3_t, Sm90>>", "fp8 gemm"),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128", "fp8 gemm"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopB_TNN", "gemm"),
    ("nvjet_sm90_qqtst_128x128_128x6_1x2_h_bz_ovscale_bias_TNT", "fp8 gemm"),  # torch 2.11's row-wise _scaled_mm
    ("triton_red_fused__scaled_mm__to_copy_abs_amax_cat_clamp_4", "inductor fused"),  # the cast before a GEMM
    ("triton_poi_fused__scaled_dot_product_cudnn_attention_add_3", "inductor fused"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "gemm"),
    ("aten::addmm", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wmma_f16_knob_7", "attention"),
    ("sdpa_fp8_fprop_e4m3", "attention"),  # FP8 attention counts as attention, not as a GEMM
    ("triton_per_fused__to_copy_abs_amax_clamp_mul_0", "inductor fused"),
    ("void at::native::elementwise_kernel<128, 4>", "other"),
])
def test_kernel_names_are_sorted_by_kind(name, kind):
    from benchmarks._step_profile import kind_of

    assert kind_of(name) == kind


def test_breakdown_sums_kernel_time_by_kind_and_keeps_the_costliest():
    from benchmarks._step_profile import KINDS, breakdown

    out = breakdown([("triton_poi_fused_mul_0", 57, 3000.0), ("sm90_xmma_gemm_e4m3bf16", 399, 60000.0),
                     ("cudnn_generated_fort_native_sdpa", 57, 16000.0), ("nvjet_bf16_gemm", 4, 1000.0)], top=2)
    assert set(out["by_kind_ms"]) == set(KINDS)
    assert out["by_kind_ms"] == {"fp8 gemm": 60.0, "gemm": 1.0, "attention": 16.0, "inductor fused": 3.0,
                                 "other": 0.0}
    assert out["total_ms"] == 80.0 and out["by_kind_share"]["fp8 gemm"] == 0.75
    assert out["top"] == [["sm90_xmma_gemm_e4m3bf16", "fp8 gemm", 399, 60.0],
                          ["cudnn_generated_fort_native_sdpa", "attention", 57, 16.0]]
    assert breakdown([])["by_kind_share"] == dict.fromkeys(KINDS, 0.0)  # nothing ran: no division by zero


def test_profile_step_splits_a_warm_call_by_kind(tmp_path):
    """--profile-step on the CPU (tiny FLUX, regional on the eager backend): the row keeps one warm call's time by
    kind, the linear layers' GEMMs and attention among them, the note says it, and torch's table is written beside.
    (On the CPU these are operators' own times; on a GPU the kernels'.)"""
    import json

    from benchmarks.bench_compile_variants import main

    assert main(["--model", "flux", "--size", "tiny", "--device", "cpu", "--dtype", "float32", "--height", "64",
                 "--width", "64", "--variants", "regional", "--backend", "eager", "--warmup", "0", "--reps", "1",
                 "--profile-step", "--out-dir", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "compile-variants-flux.json").read_text())["rows"]
    profile = row["step_profile"]
    assert profile["by_kind_ms"]["gemm"] > 0 and profile["by_kind_ms"]["attention"] > 0, profile
    assert profile["total_ms"] == pytest.approx(sum(profile["by_kind_ms"].values()), abs=0.01)
    assert profile["outside_kernels_ms"] == pytest.approx(row["median_ms"] - profile["total_ms"], abs=0.01)
    assert "kernel ms by kind" in row["note"] and "outside kernels" in row["note"] and "host" in row["note"]
    assert 0 < profile["host_ms"] < 60_000, profile  # the CPU operators' own time of the one profiled call
    assert "Self CPU" in (tmp_path / "step-regional.txt").read_text()
