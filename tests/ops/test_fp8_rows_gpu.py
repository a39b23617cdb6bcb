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
