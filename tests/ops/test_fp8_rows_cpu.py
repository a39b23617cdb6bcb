"""The one-pass row-wise FP8 quantizer on the CPU (`xstage_dit.ops.fp8_rows`): its reference is torchao 0.18.0's own
row-wise quantization of ``cat([a, gelu_tanh(b)])`` bit for bit, the Triton kernel under TRITON_INTERPRET=1 is the
reference bit for bit, the custom op traces under ``torch.compile`` without a graph break, and bad inputs are named.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from xstage_dit.ops.fp8_rows import MAX_ROW_WIDTH, quantize_rows, quantize_rows_reference
from xstage_dit.ops.fp8_rows.reference import E4M3_MAX, RECIP_E4M3_MAX

from tests.helpers.interp import run_interp_script
from tests.ops._fp8_rows_interp_cases import CASES as INTERP_CASES

# (rows, Ka, Kb); no row of width 1: torchao 0.18.0's PerRow fails on one (its scale's reshape), our op does not.
SHAPES = [(1, 0, 17), (3, 1, 1), (37, 17, 0), (37, 24, 100), (5, 0, 2), (3, 48, 200), (2, 3, 61)]


def torchao_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's row-wise dynamic activation quantization of x (M, K): Float8Tensor.from_hp with PerRow(), the call
    Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()) makes for a linear layer's input."""
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    t = Float8Tensor.from_hp(x, granularity=PerRow())
    return t.qdata, t.scale


def _draw(rows: int, cols: int, dtype: torch.dtype, gen: torch.Generator, how: str = "randn") -> torch.Tensor:
    x = torch.randn(rows, cols, generator=gen)
    if how == "wide":
        x = x * torch.exp2(torch.randint(-20, 20, (rows, cols), generator=gen).float())
    elif how == "huge":
        x = x.clamp(-1, 1) * torch.finfo(dtype).max
    elif how == "zero_rows":
        x[::2] = 0.0
    return x.to(dtype)


def _assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, scale), (q_want, scale_want) = got, want
    assert q.dtype == torch.float8_e4m3fn and q.shape == q_want.shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == scale_want.shape == (q.shape[0], 1)
    differing = int((q.view(torch.uint8) != q_want.view(torch.uint8)).sum())
    assert differing == 0, f"{differing} of {q.numel()} e4m3 bytes differ"
    assert torch.equal(scale.view(torch.int32), scale_want.view(torch.int32)), (scale, scale_want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("how", ["randn", "wide", "huge", "zero_rows"])
@pytest.mark.parametrize("gelu_b", [True, False])
def test_reference_is_torchaos_row_quantization(dtype, how, gelu_b):
    gen = torch.Generator().manual_seed(hash((str(dtype), how, gelu_b)) % 2**31)
    for rows, ka, kb in SHAPES:
        a, b = _draw(rows, ka, dtype, gen, how), _draw(rows, kb, dtype, gen, how)
        x = torch.cat([a, F.gelu(b, approximate="tanh") if gelu_b else b], dim=-1)  # diffusers: GELU in bf16
        _assert_same(quantize_rows_reference(a, b, gelu_b), torchao_rows(x))
        _assert_same(quantize_rows(a, b, gelu_b), torchao_rows(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_amax_floor_is_torchaos_activation_value_lb(dtype):
    """The floor (the FP8 feature's: Wan's zero-padded text tokens are rows of zeros, NaN without one) is
    torchao's ``hp_value_lb``: a zero row quantizes to zeros, a row above the floor as without it."""
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    gen = torch.Generator().manual_seed(5)
    a, b = _draw(6, 10, dtype, gen, "zero_rows"), _draw(6, 30, dtype, gen, "zero_rows")
    b[3] = b[3] * 1e-6  # a row under the floor
    x = torch.cat([a, F.gelu(b, approximate="tanh")], dim=-1)
    t = Float8Tensor.from_hp(x, granularity=PerRow(), hp_value_lb=2.0 ** -15)
    got = quantize_rows(a, b, True, amax_floor=2.0 ** -15)
    _assert_same(got, (t.qdata, t.scale))
    assert not got[0].float().isnan().any() and got[0][0].float().eq(0).all()
    _assert_same(quantize_rows(a[1::2], b[1::2], True, amax_floor=1e-30), quantize_rows(a[1::2], b[1::2], True))


def test_an_absent_part_is_an_empty_one():
    gen = torch.Generator().manual_seed(0)
    a, b = _draw(4, 9, torch.bfloat16, gen), _draw(4, 13, torch.bfloat16, gen)
    _assert_same(quantize_rows(None, b, True), quantize_rows(a[:, :0], b, True))
    _assert_same(quantize_rows(a, None, True), torchao_rows(a))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_scale_divided_or_multiplied_by_the_reciprocal(dtype):
    """torchao's ``amax / 448`` in the input dtype: torch's CPU kernel divides, its CUDA kernel multiplies by
    fp32(1/448). Rounded to bf16 the two agree for every finite amax; rounded to fp16 for every amax whose scale is
    a normal fp16 (amax >= 448 * 2**-14), and for all but a few dozen below, where the fp16 scale is subnormal and
    the exact quotient can be a tie. The reference (and the kernel) is the CUDA one."""
    bits = torch.arange(0, 2**15, dtype=torch.int32).to(torch.int16)  # every non-negative bit pattern
    values = bits.view(dtype)
    values = values[torch.isfinite(values)].float()
    divided = (values / E4M3_MAX).to(dtype)
    multiplied = (values * RECIP_E4M3_MAX).to(dtype)
    differ = values[divided.view(torch.int16) != multiplied.view(torch.int16)]
    if dtype == torch.bfloat16:
        assert differ.numel() == 0, differ
    else:
        assert differ.numel() < 64 and bool((differ < E4M3_MAX * 2.0**-14).all()), differ


@pytest.fixture(scope="module")
def interp_results() -> dict:
    return run_interp_script(Path(__file__).with_name("_fp8_rows_interp_cases.py"))


@pytest.mark.parametrize("case", sorted(INTERP_CASES))
def test_the_triton_kernel_in_the_interpreter_is_the_reference(interp_results, case):
    r = interp_results[case]
    rows, ka, kb = INTERP_CASES[case][:3]
    assert r["q_shape"] == r["ref_shape"] == [rows, ka + kb] and r["scale_shape"] == [rows, 1] and r["q_contiguous"]
    assert r["q_bytes_differing"] == 0 and r["scale_differing"] == 0, r


def test_the_op_traces_without_a_graph_break():
    gen = torch.Generator().manual_seed(1)
    a, b = _draw(6, 10, torch.bfloat16, gen), _draw(6, 22, torch.bfloat16, gen)

    def proj_out_input(a, b):
        q, scale = quantize_rows(a, b, gelu_b=True)
        return q, scale * 2.0

    compiled = torch.compile(proj_out_input, backend="aot_eager", fullgraph=True)  # fullgraph: a break raises
    q, scale2 = compiled(a, b)
    _assert_same((q, scale2 / 2.0), quantize_rows_reference(a, b, True))
    torch._dynamo.reset()


def test_the_custom_op_passes_opcheck():
    gen = torch.Generator().manual_seed(2)
    a, b = _draw(3, 5, torch.bfloat16, gen), _draw(3, 7, torch.bfloat16, gen)
    for args in ((a, b, True, False, 0.0), (None, b, False, True, 2.0 ** -15), (a, None, False, False, 0.0)):
        torch.library.opcheck(torch.ops.xstage_dit.fp8_rows.default, args)


BF16 = torch.bfloat16


@pytest.mark.parametrize("a, b, match", [
    (None, None, "got None for both"),
    (torch.zeros(4, 3, 2, dtype=BF16), None, r"a to be 2-D .* \(4, 3, 2\)"),
    (torch.zeros(4, 3, dtype=torch.int32), None, "a of dtype .* got torch.int32"),
    (torch.zeros(4, 3, dtype=BF16), torch.zeros(5, 3, dtype=BF16), r"same rows, got a \(4, 3\) and b \(5, 3\)"),
    (torch.zeros(4, 3, dtype=BF16), torch.zeros(4, 3, dtype=torch.float16), "one dtype, got a torch.bfloat16"),
    (torch.zeros(4, 0, dtype=BF16), torch.zeros(4, 0, dtype=BF16), "at least one column"),
    (None, torch.zeros(2, MAX_ROW_WIDTH + 1, dtype=BF16), f"Ka \\+ Kb <= {MAX_ROW_WIDTH} .* = {MAX_ROW_WIDTH + 1}"),
    (torch.zeros(3, 8, dtype=BF16)[:, ::2], None, "contiguous last dim, got strides"),
    (torch.zeros(3, 8, dtype=BF16), torch.zeros(3, 8, dtype=BF16, device="meta"), "one device, got a on cpu"),
])
def test_bad_inputs_are_named(a, b, match):
    with pytest.raises(ValueError, match=match):
        quantize_rows(a, b, True)
