"""The one-pass row quantizer's Triton kernel on a GPU, at FLUX.1-dev's shapes (1024x1024: 4096 image + 512 text
tokens), against its reference run by torch on the same GPU: bit for bit (e4m3 bytes and fp32 scales)."""

from __future__ import annotations

import pytest
import torch

from xstage_dit.ops.fp8_rows import quantize_rows, quantize_rows_reference

pytestmark = pytest.mark.gpu

CASES = {  # name: (rows, Ka, Kb, gelu_b), where FLUX quantizes them
    "single_block_proj_out": (4608, 3072, 12288, True),  # cat([attn_out, gelu(proj_mlp(x))])
    "double_block_ff_out": (4096, 0, 12288, True),  # gelu(ff.net[0](x)), image stream
    "double_block_context_ff_out": (512, 0, 12288, True),  # the text stream's
    "plain_3072": (4608, 3072, 0, False),  # the inputs of the 3072-wide linear layers
    "odd_widths_zero_row": (37, 17, 301, True),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_is_its_reference_on_the_gpu(name, dtype):
    rows, ka, kb, gelu_b = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(rows + ka + kb)
    a = torch.randn(rows, ka, device="cuda", generator=gen).to(dtype) if ka else None
    b = (torch.randn(rows, kb, device="cuda", generator=gen) * 3).to(dtype)
    if name == "odd_widths_zero_row":
        a[5], b[5] = 0.0, 0.0
    q, scale = quantize_rows(a, b, gelu_b)
    q_ref, scale_ref = quantize_rows_reference(a, b, gelu_b)
    differing = q.view(torch.uint8) != q_ref.view(torch.uint8)
    in_gelu = differing[:, ka:].sum().item()
    assert not differing.any(), (f"{int(differing.sum())} of {q.numel()} bytes differ, {in_gelu} in the GELU part "
                                 "(libdevice's tanh against CUDA's tanhf there)")
    assert torch.equal(scale.view(torch.int32), scale_ref.view(torch.int32))


def _e4m3_steps(q: torch.Tensor, q_ref: torch.Tensor) -> torch.Tensor:
    """How far apart two e4m3 tensors are, in steps of e4m3's grid (same-sign finite values: their bytes'
    distance as integers, since e4m3's positive codes ascend with their values)."""
    a, b = q.view(torch.uint8).int(), q_ref.view(torch.uint8).int()
    return ((a & 0x7F) - (b & 0x7F)).abs() + 255 * ((a ^ b) & 0x80).ne(0).int()


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_approximate_kernel_is_within_one_step_of_its_reference(name):
    """approx=True (the FP8 feature's): the GPU's tanh.approx and a reciprocal product. Bound: a differing byte
    is one e4m3 step off, at most 0.3 % of the bytes differ (measured on an H100, 2026-12-07: 0.13-0.16 % at these
    GELU inputs of standard deviation 3, 0.02 % at 1), and a scale differs only by the bf16 step an approximate
    GELU can move a row's amax by."""
    rows, ka, kb, gelu_b = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(rows + ka + kb)
    a = torch.randn(rows, ka, device="cuda", generator=gen).to(torch.bfloat16) if ka else None
    b = (torch.randn(rows, kb, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    if name == "odd_widths_zero_row":
        a[5], b[5] = 0.0, 0.0
    q, scale = quantize_rows(a, b, gelu_b, approx=True)
    q_ref, scale_ref = quantize_rows_reference(a, b, gelu_b)
    same_scale = scale.view(torch.int32) == scale_ref.view(torch.int32)
    assert torch.allclose(scale[~same_scale], scale_ref[~same_scale], rtol=2 ** -7, atol=0)
    steps = _e4m3_steps(q, q_ref)[same_scale.squeeze(1)]
    nan = q_ref.float().isnan()[same_scale.squeeze(1)]
    worst = int(steps[~nan].max()) if steps[~nan].numel() else 0
    assert worst <= 1, f"a byte {worst} e4m3 steps off"
    assert q.float().isnan()[same_scale.squeeze(1)].eq(nan).all()
    assert int(steps.ne(0).sum()) <= 3e-3 * q.numel(), f"{int(steps.ne(0).sum())} of {q.numel()} bytes differ"
    if not gelu_b:  # no tanh: the product and the GPU's conversion alone
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
