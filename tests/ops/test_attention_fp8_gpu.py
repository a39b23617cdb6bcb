"""GPU checks of the 8-bit attention kernels (``ops/attention/fp8_kernels.py``): the device quantizer equals its
torch definition bit for bit, the store kernel dequantizes into strided views, and every 8-bit kernel matches the
fp32 reference within its stated bound (tests/helpers/tolerances.py: ``cudnn_fp8_attention``, ``sage_attention``)
and its own fp32 emulation within ``fp8_over_emulation``, at world 1 (the plain path) and through a NaN-poisoned
peer window of P virtual ranks (padding rows never written), on the served shapes and awkward ones. Inputs are
never modified. Marked `gpu`; a kernel whose package or GPU is missing skips visibly with the reason.

Printed per case (``pytest -s``): the kernel's and the emulation's rel L2 against fp32.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tolerances import TOL, rel_err

FP8 = ["cudnn-fp8", "sage"]
BOUND = {"cudnn-fp8": TOL.cudnn_fp8_attention, "sage": TOL.sage_attention}
WORLD1 = [  # batch, seq_len, heads, head_dim, dtype
    (1, 4608, 24, 128, torch.bfloat16),   # FLUX 1024^2
    (2, 4608, 24, 128, torch.bfloat16),   # with CFG batch 2
    (1, 1000, 5, 64, torch.float16),      # head_dim 64, fp16
    (1, 4097, 3, 128, torch.bfloat16),    # one row past a tile
    (2, 17, 2, 128, torch.bfloat16),      # shorter than a tile
]
WINDOW = [  # batch, seq_len, heads, head_dim, ranks
    (1, 4608, 24, 128, 2),                # FLUX at sp = 2
    (2, 4608, 24, 128, 8),
    (1, 4607, 6, 128, 4),                 # S not divisible by P: padding rows
    (2, 1000, 5, 64, 2),                  # H not divisible by P
    (1, 5, 4, 128, 4),                    # an empty owner
]


def _emulation(name):
    from xstage_dit.ops.attention import fp8_reference

    return {"cudnn-fp8": fp8_reference.cudnn_fp8_emulation, "sage": fp8_reference.sage_emulation}[name]


def _kernel_or_skip(name, world, batch, seq_len, heads, head_dim, dtype):
    from xstage_dit.ops.attention.kernels import make_kernel
    from xstage_dit.ops.attention.window import WindowGeometry

    length = -(-seq_len // world)
    kernel = make_kernel(name)
    reason = kernel.supports(WindowGeometry(world, batch, seq_len, heads, head_dim, length * heads * head_dim), dtype,
                             torch.device("cuda"), True)
    if reason:
        pytest.skip(f"{name} refuses: {reason}")
    return kernel


def _check(name, out, q, k, v):
    from xstage_dit.ops.attention.reference import attention_reference

    exact = attention_reference(q.float(), k.float(), v.float())
    err, emulated = rel_err(out, exact), rel_err(_emulation(name)(q, k, v), exact)
    print(f"{name} {tuple(q.shape)} {q.dtype}: rel L2 vs fp32 {err:.4f} (emulation {emulated:.4f})")
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) or NaN output"
    assert err < BOUND[name], (err, emulated)
    assert err < TOL.fp8_over_emulation * emulated + TOL.bf16_kernel, (err, emulated)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 333, 3, 64), (1, 4608, 24, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantizer_is_its_torch_definition_bit_for_bit(shape, dtype):
    from xstage_dit.ops.attention.fp8_quant import (DESCALE_K, DESCALE_O, DESCALE_Q, DESCALE_V, SCALE_O,
                                                    quantize_qkv)
    from xstage_dit.ops.attention.fp8_reference import quantize_reference

    batch, seq_len, heads, head_dim = shape
    qkv = torch.randn(batch, seq_len + 7, 3, heads + 1, head_dim, device="cuda", dtype=dtype)
    qkv[..., 0, :, :] *= 40.0  # three different scales
    q, k, v = qkv[:, :seq_len, 0, :heads], qkv[:, 3:, 1, 1:], qkv[:, 3:, 2, 1:]  # strided views, other row counts
    v[0, 0, 0, 0] = 0.0
    before = qkv.clone()
    x = quantize_qkv(q, k, v)
    assert torch.equal(qkv, before)
    for got, src, slot in ((x.q, q, DESCALE_Q), (x.k, k, DESCALE_K), (x.v, v, DESCALE_V)):
        want, descale = quantize_reference(src)
        assert got.shape == src.shape and got.is_contiguous()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(x.slot(slot), descale)
    _, descale_v = quantize_reference(v)
    assert float(x.slot(SCALE_O)) == 0.5 / float(descale_v) and float(x.slot(DESCALE_O)) == 2 * float(descale_v)
    zeros = quantize_qkv(*(torch.zeros(1, 9, 2, 64, device="cuda", dtype=dtype) for _ in range(3)))
    assert not zeros.q.float().any() and torch.isfinite(zeros.scales).all()


@pytest.mark.gpu
def test_store_rows_dequantizes_into_a_strided_view_and_nowhere_else():
    from xstage_dit.ops.attention.fp8_quant import store_rows

    src = (torch.randn(2, 12, 3, 64, device="cuda") * 100).to(torch.float8_e4m3fn)  # P = 3, L = 4, S = 10
    window = torch.full((6, 4, 5, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    descale = torch.tensor([0.125], device="cuda")
    store_rows(src, window[:, :, 1:4], world_size=3, seq_len=10, descale=descale)
    want = (src.float() * 0.125).to(torch.bfloat16)
    for b in range(2):
        for o, rows in enumerate((4, 4, 2)):
            assert torch.equal(window[b * 3 + o, :rows, 1:4], want[b, o * 4:o * 4 + rows])
            assert torch.isnan(window[b * 3 + o, rows:]).all()
    assert torch.isnan(window[:, :, 0]).all() and torch.isnan(window[:, :, 4]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("name", FP8)
@pytest.mark.parametrize("batch, seq_len, heads, head_dim, dtype", WORLD1)
def test_world1_plain_path_matches_fp32_within_its_bound(name, batch, seq_len, heads, head_dim, dtype):
    from xstage_dit.ops.attention.window_path import plain_kernel_attention

    kernel = _kernel_or_skip(name, 1, batch, seq_len, heads, head_dim, dtype)
    qkv = torch.randn(batch, seq_len, 3, heads, head_dim, device="cuda", dtype=dtype)
    q, k, v = qkv.unbind(2)  # non-contiguous views, as a fused QKV projection leaves them
    before = qkv.clone()
    out = plain_kernel_attention(q, k, v, kernel)
    assert torch.equal(qkv, before), f"{name} modified its inputs"
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    _check(name, out, q, k, v)
    assert torch.equal(plain_kernel_attention(q, k, v, kernel), out), f"{name} is not deterministic run to run"


@pytest.mark.gpu
@pytest.mark.parametrize("batch, seq_len, heads, head_dim, dtype", WORLD1)
def test_world1_cudnn_fp8_with_torch_casts_is_the_eager_path_bit_for_bit(batch, seq_len, heads, head_dim, dtype):
    """`fp8_traced` (what a compiled stack runs at world 1), eager and compiled, against the Triton quantizers and
    store around the same cuDNN plan; the sweep times it compiled beside the eager path, on its own and inside a
    block's elementwise kernels beside torch SDPA there."""
    from xstage_dit.ops.attention.fp8_traced import cudnn_fp8_attention
    from xstage_dit.ops.attention.window_path import _world1_cases, plain_kernel_attention

    kernel = _kernel_or_skip("cudnn-fp8", 1, batch, seq_len, heads, head_dim, dtype)
    q, k, v = torch.randn(batch, seq_len, 3, heads, head_dim, device="cuda", dtype=dtype).unbind(2)
    want = plain_kernel_attention(q, k, v, kernel)
    assert torch.equal(cudnn_fp8_attention(q, k, v), want)
    torch._dynamo.reset()
    try:
        assert torch.equal(torch.compile(cudnn_fp8_attention, fullgraph=True, dynamic=False)(q, k, v), want)
        # q's and k's true amax as their bounds: the same scales, so the same output
        bounds = (q.float().abs().amax(), k.float().abs().amax())
        assert torch.equal(cudnn_fp8_attention(q, k, v, amax_bounds=bounds), want)
        for bounded in (False, True):
            cases = _world1_cases(batch, seq_len, heads, head_dim, dtype, "cuda", ("sdpa", "cudnn-fp8"), bounded)
            assert {"cudnn-fp8", "cudnn-fp8+compiled", "cudnn-fp8+in-block", "sdpa+in-block"} <= set(cases)
            for name in ("cudnn-fp8+compiled", "cudnn-fp8+in-block", "sdpa+in-block"):
                cases[name]()
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("name", FP8)
@pytest.mark.parametrize("batch, seq_len, heads, head_dim, world", WINDOW)
def test_through_the_window_of_virtual_ranks(name, batch, seq_len, heads, head_dim, world):
    from xstage_dit.ops.attention.window_path import window_attention_virtual_ranks

    kernel = _kernel_or_skip(name, world, batch, seq_len, heads, head_dim, torch.bfloat16)
    q, k, v = (torch.randn(batch, seq_len, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    run = window_attention_virtual_ranks(q, k, v, world_size=world, kernel=kernel)
    try:
        out = torch.cat(run.outs, dim=1)
        assert out.shape == q.shape
        length = run.geom.rows_per_owner
        for b, o, first, end in run.geom.padding_rows():
            pad = run.window.slot_tensor(b, o, torch.bfloat16, (length, heads, head_dim))[first:end]
            assert torch.isnan(pad).all(), f"{name} wrote padding rows of owner {o}"
        # Each rank quantizes its own heads (its own scales): the emulation of the whole tensor is close, not equal.
        _check(name, out, q, k, v)
    finally:
        run.window.close()


@pytest.mark.gpu
@pytest.mark.parametrize("name", FP8)
def test_the_ulysses_op_runs_the_kernel_named_in_the_schedule_eager_and_compiled(name):
    from xstage_dit.ops.attention import ulysses_attention

    _kernel_or_skip(name, 1, 1, 4608, 24, 128, torch.bfloat16)
    q, k, v = (torch.randn(1, 4608, 24, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    eager = ulysses_attention(q, k, v, schedule=f"fused:{name}")
    _check(name, eager, q, k, v)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda q, k, v: ulysses_attention(q, k, v, schedule=f"fused:{name}"), fullgraph=True)
        assert torch.equal(compiled(q, k, v), eager)  # the same kernel behind the custom op
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("batch, seq_q, seq_k, kept, scattered", [
    (2, 4096, 4272, (4272, 4150), False),  # NucleusMoE 1024^2: image queries over image + text keys, one text padded
    (2, 4096, 4272, (4272, 4272), False),  # every key kept: the padded graph on a full mask
    (1, 1000, 1100, (1037,), True),        # a scattered mask (the kept keys moved first), odd lengths
])
def test_world1_cudnn_fp8_takes_a_key_padding_mask(batch, seq_q, seq_k, kept, scattered):
    """`fp8_traced` with a key mask (cuDNN's padding mask over the kept keys, per-sample lengths), eager and compiled,
    against the fp32 masked reference within cudnn-fp8's bound and its masked emulation's error."""
    from xstage_dit.ops.attention.fp8_reference import cudnn_fp8_emulation
    from xstage_dit.ops.attention.fp8_traced import cudnn_fp8_attention

    heads, head_dim = 16, 128
    _kernel_or_skip("cudnn-fp8", 1, batch, seq_q, heads, head_dim, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(batch, seq_q, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(batch, seq_k, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    mask = torch.arange(seq_k, device="cuda")[None, :] < torch.tensor(kept, device="cuda")[:, None]
    if scattered:
        mask = torch.rand(batch, seq_k, device="cuda", generator=gen) < 0.9
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2),
        attn_mask=mask[:, None, None, :]).transpose(1, 2)
    out = cudnn_fp8_attention(q, k, v, key_mask=mask)
    err, emulated = rel_err(out, exact), rel_err(cudnn_fp8_emulation(q, k, v, key_mask=mask), exact)
    print(f"cudnn-fp8 masked {tuple(q.shape)} keys {seq_k} kept {kept}: rel L2 vs fp32 {err:.4f} "
          f"(emulation {emulated:.4f})")
    assert not torch.isnan(out).any()
    assert err < TOL.cudnn_fp8_attention and err < TOL.fp8_over_emulation * emulated + TOL.bf16_kernel, (err, emulated)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(cudnn_fp8_attention, fullgraph=True, dynamic=False)(q, k, v, key_mask=mask)
    finally:
        torch._dynamo.reset()
    assert rel_err(compiled, out) < 1e-2  # Inductor's casts: the same values but for fp32 rounding order

