"""The 8-bit attention kernels on the CPU: the quantization's definition (power-of-two per-tensor scales, e4m3
rounding only, no overflow), the emulated errors against the fp32 reference the GPU tests' bounds rest on, the
plumbing of the window kernels (which rows and keys reach the kernel, every valid row stored once, padding rows and
slot gaps untouched) through the Triton store kernel in the interpreter, and each kernel's refusals where it cannot
run, naming why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from xstage_dit.ops.attention import fp8_reference as ref8
from xstage_dit.ops.attention import cudnn_fp8, sage
from xstage_dit.ops.attention.kernels import make_kernel
from xstage_dit.ops.attention.reference import attention_reference
from xstage_dit.ops.attention.window import WindowGeometry
from xstage_dit.ops.attention.window_path import problem_family, problem_refusals
from xstage_dit.schedule.attention_kernel import FP8_KERNELS

from tests.helpers.interp import run_interp_script
from tests.helpers.tolerances import TOL

CUDNN_FP8_BOUND, SAGE_BOUND = TOL.cudnn_fp8_attention, TOL.sage_attention


def test_scales_are_powers_of_two_and_nothing_overflows():
    gen = torch.Generator().manual_seed(0)
    for amax in (1e-3, 0.7, 1.0, 3.9, 448.0, 5e4):
        x = torch.randn(257, 3, generator=gen) * amax
        x.view(-1)[17] = amax  # the largest magnitude, exactly
        x8, descale = ref8.quantize_reference(x)
        scale = 1.0 / descale.item()
        assert x8.dtype == torch.float8_e4m3fn and x8.shape == x.shape and x8.is_contiguous()
        assert scale == 2.0 ** round(torch.log2(torch.tensor(scale)).item()), scale
        assert 224.0 < x.abs().max().item() * scale <= 448.0
        back = x8.float() * descale
        assert torch.isfinite(back).all()
        # e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value (normal range) or 2**-10 of 1/scale.
        err = (back - x).abs()
        assert bool((err <= x.abs() / 16 + 2.0 ** -10 / scale).all())
    zeros8, descale = ref8.quantize_reference(torch.zeros(4, 8, dtype=torch.bfloat16))
    assert torch.equal(zeros8.float(), torch.zeros(4, 8)) and torch.isfinite(descale).all()
    with pytest.raises(ValueError, match="expected a floating-point tensor to quantize, got torch.int32"):
        ref8.quantize_reference(torch.ones(3, dtype=torch.int32))


@pytest.mark.parametrize("shape", [(1, 512, 4, 128), (2, 333, 3, 64)])
def test_emulated_errors_against_fp32_are_what_the_gpu_bounds_rest_on(shape):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(3))
    exact = attention_reference(q.float(), k.float(), v.float())
    bf16 = ref8.rel_l2(attention_reference(q, k, v), exact)
    cudnn = ref8.rel_l2(ref8.cudnn_fp8_emulation(q, k, v), exact)
    cudnn_bf16_out = ref8.rel_l2(ref8.cudnn_fp8_emulation(q, k, v, quantize_out=False), exact)
    sage_err = ref8.rel_l2(ref8.sage_emulation(q, k, v), exact)
    assert bf16 < 0.005
    # Lossy, and by how much: the e4m3 roundings show (>> bf16's), within the stated bounds.
    assert 10 * bf16 < cudnn < CUDNN_FP8_BOUND and cudnn_bf16_out < cudnn
    assert 3 * bf16 < sage_err < SAGE_BOUND


def test_emulations_take_other_key_counts_and_keep_the_dtype():
    q = torch.randn(2, 7, 3, 64).half()
    k, v = torch.randn(2, 19, 3, 64).half(), torch.randn(2, 19, 3, 64).half()
    for fn in (ref8.cudnn_fp8_emulation, ref8.sage_emulation):
        out = fn(q, k, v, scale=0.1)
        assert out.shape == q.shape and out.dtype == torch.float16
        assert ref8.rel_l2(out, attention_reference(q.float(), k.float(), v.float(), 0.1)) < CUDNN_FP8_BOUND


@pytest.fixture(scope="module")
def interp_store_results() -> dict:
    return run_interp_script(Path(__file__).with_name("_fp8_store_interp_cases.py"))


@pytest.mark.parametrize("case", ["p1_b2", "p2_b2_uneven_heads", "p4_b1_padding_descale", "p4_empty_owner",
                                  "p3_b2_descale"])
def test_window_plumbing_stores_every_valid_row_once(interp_store_results, case):
    r = interp_store_results[case]
    assert r["shape_ok"], r
    assert not r["nan"], f"unwritten (NaN-poisoned) output: {r}"
    assert r["padding_untouched"], f"a padding row or a slot gap was written: {r}"
    assert r["rows_seen"] == [r["rows_expected"]], "the kernel must see P*L query rows and exactly S keys"
    assert r["rel_err"] < 1.5e-2, r


def test_the_device_quantizers_scales_are_its_definitions(interp_store_results):
    r = interp_store_results["quantize_scales"]
    assert r["amax"] == r["amax_expected"] and r["descale"] == r["descale_expected"], r
    assert r["o_scales"] == r["o_scales_expected"] and r["shapes_ok"], r


def test_the_8bit_kernels_refuse_a_cpu_a_pointer_table_and_fp32_naming_why():
    geom = WindowGeometry(2, 1, 64, 4, 128, 32 * 4 * 128)
    cpu = torch.device("cpu")
    for name in FP8_KERNELS:
        kernel = make_kernel(name)
        assert "needs a CUDA device, got cpu" in kernel.supports(geom, torch.bfloat16, cpu, True), name
        assert "needs the peer window" in kernel.supports(geom, torch.bfloat16, cpu, False), name
        assert "takes float16/bfloat16 inputs, got torch.float32" in kernel.supports(geom, torch.float32, cpu, True)
    for world in (1, 4):
        problem = dict(batch=1, seq_len=4608, heads=24, head_dim=128, world_size=world, dtype=torch.bfloat16,
                       device=cpu)
        plain, with_fp8 = problem_refusals(**problem), problem_refusals(**problem, fp8=True)
        assert not set(FP8_KERNELS) & set(plain) and set(with_fp8) == set(plain) | set(FP8_KERNELS)
        assert all("CUDA device" in with_fp8[name] for name in FP8_KERNELS)
        family = problem_family(**{k: v for k, v in problem.items() if k != "device"})
        assert problem_family(**{k: v for k, v in problem.items() if k != "device"}, fp8=True) == family + "-fp8"


def test_a_missing_device_or_package_is_named():
    assert "needs a CUDA device, got cpu" in cudnn_fp8.unavailable(torch.device("cpu"), 128)
    assert "needs a CUDA device, got cpu" in sage.unavailable(torch.device("cpu"), 128, 4608)
    sage._sageattn.cache_clear()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sage, "version", lambda: "1.0.5")
            with pytest.raises(sage.SageUnavailable, match=r"expected sageattention==1\.0\.6 .*got 1\.0\.5"):
                sage._sageattn()
            mp.setattr(sage, "version", lambda: None)
            sage._sageattn.cache_clear()
            with pytest.raises(sage.SageUnavailable, match="got none"):
                sage._sageattn()
    finally:
        sage._sageattn.cache_clear()


def test_sage_is_refused_where_its_unmasked_key_padding_would_weigh_in_the_softmax(monkeypatch):
    """sageattention 1.0.6 reads the keys padding its last block of 64 as zeros and weighs them (found on an H100:
    rel L2 0.64 at 17 keys). The same padding in torch reproduces that error, and the kernel is refused for such
    key counts, by name and count, on every path that asks ``supports``."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 17, 2, 128, generator=gen) for _ in range(3))
    padded_k, padded_v = (torch.cat([t, t.new_zeros(2, 47, 2, 128)], dim=1) for t in (k, v))
    exact = attention_reference(q, k, v)
    assert torch.linalg.vector_norm(attention_reference(q, padded_k, padded_v) - exact) > 0.5 * exact.norm()

    monkeypatch.setattr(sage, "capability_refusal", lambda *args: None)  # a CPU stands in for a GPU here
    monkeypatch.setattr(sage, "_sageattn", lambda: None)  # and the package is taken as installed
    assert sage.unavailable(torch.device("cuda"), 128, 4608) is None
    for kv_len, pad in ((17, 47), (4607, 1), (32760, 8)):
        reason = sage.unavailable(torch.device("cuda"), 128, kv_len)
        assert f"the {pad} zero keys" in reason and f"got {kv_len}" in reason, reason
        geom = WindowGeometry(2, 1, kv_len, 4, 128, -(-kv_len // 2) * 4 * 128)
        assert make_kernel("sage").supports(geom, torch.bfloat16, torch.device("cuda"), True) == reason
