"""GPU checks of cuDNN's padded 16-bit SDPA (``ops/attention/cudnn_padded.py``): against the fp32 masked reference
within a bf16 kernel's bound at NucleusMoE's shape (one text padded, a full mask, a scattered mask) and an awkward
fp16 one, eager and compiled; later calls bind by address and still read each call's own key lengths; against torch's
SDPA with the same mask. Marked `gpu`; skipped visibly where cuDNN's frontend or a GPU is missing."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tolerances import TOL, rel_err

CASES = [  # batch, seq_q, seq_k, heads, head_dim, dtype, kept (None: a scattered mask)
    (2, 4096, 4272, 16, 128, torch.bfloat16, (4272, 4150)),  # NucleusMoE 1024^2, CFG's pair, one text padded
    (2, 4096, 4272, 16, 128, torch.bfloat16, (4272, 4272)),  # every key kept
    (1, 1000, 1100, 5, 64, torch.float16, None),             # odd lengths, head_dim 64, fp16, a scattered mask
]


def _or_skip(head_dim, dtype):
    from xstage_dit.ops.attention.cudnn_padded import unavailable

    reason = unavailable(torch.device("cuda"), head_dim, dtype) if torch.cuda.is_available() else "no CUDA GPU"
    if reason:
        pytest.skip(f"cudnn-padded refuses: {reason}")


def _reference(q, k, v, mask):
    return torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2),
        attn_mask=mask[:, None, None, :]).transpose(1, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, seq_q, seq_k, heads, head_dim, dtype, kept", CASES)
def test_padded_matches_the_fp32_masked_reference_eager_and_compiled(batch, seq_q, seq_k, heads, head_dim, dtype,
                                                                     kept):
    from xstage_dit.ops.attention.cudnn_padded import cudnn_padded_attention

    _or_skip(head_dim, dtype)
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(batch, seq_q, heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(batch, seq_k, heads, head_dim, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    if kept is None:
        mask = torch.rand(batch, seq_k, device="cuda", generator=gen) < 0.9
    else:
        mask = torch.arange(seq_k, device="cuda")[None, :] < torch.tensor(kept, device="cuda")[:, None]
    exact = _reference(q, k, v, mask)
    out = cudnn_padded_attention(q, k, v, mask)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :]).transpose(1, 2)
    err, err_sdpa = rel_err(out, exact), rel_err(sdpa, exact)
    print(f"cudnn-padded {tuple(q.shape)} keys {seq_k}: rel L2 vs fp32 {err:.5f} (torch SDPA masked {err_sdpa:.5f})")
    assert out.shape == q.shape and out.dtype == dtype and not torch.isnan(out).any()
    assert err < TOL.bf16_kernel, (err, err_sdpa)
    # a second call: bound by address now; other key lengths must be read, not the first call's
    if kept is not None and batch == 2:
        shorter = torch.arange(seq_k, device="cuda")[None, :] < torch.tensor([seq_k - 300, 7], device="cuda")[:, None]
        assert rel_err(cudnn_padded_attention(q, k, v, shorter), _reference(q, k, v, shorter)) < TOL.bf16_kernel
    assert torch.equal(cudnn_padded_attention(q, k, v, mask), out)  # deterministic run to run
    torch._dynamo.reset()
    try:
        compiled = torch.compile(cudnn_padded_attention, fullgraph=True, dynamic=False)(q, k, v, mask)
    finally:
        torch._dynamo.reset()
    assert torch.equal(compiled, out)  # the gather is exact: the same kernel on the same values


@pytest.mark.gpu
def test_the_masked_family_times_every_taker_at_nucleusmoes_shape():
    """`masked_sweep.masked_cases` on the GPU at NucleusMoE's query shape: torch SDPA with a key mask, the padded
    16-bit kernel and the compiled padded FP8 path all run; their times printed (what the masked choice compares)."""
    from xstage_dit.calibration.kernel_sweep import cuda_event_ms
    from xstage_dit.ops.attention.cudnn_fp8 import unavailable as fp8_unavailable
    from xstage_dit.ops.attention.masked_sweep import masked_cases

    _or_skip(128, torch.bfloat16)
    torch._dynamo.reset()
    try:
        fns = masked_cases(1, 4096, 16, 128, torch.bfloat16, "cuda", fp8=True, qk_bounded=True)
        want = {"sdpa", "cudnn-padded"} | ({"cudnn-fp8+compiled"} if fp8_unavailable(torch.device("cuda"), 128) is None
                                           else set())
        assert set(fns) == want
        times = {name: cuda_event_ms(fn) for name, fn in fns.items()}
    finally:
        torch._dynamo.reset()
    print(f"masked (1, 4096, 16, 128): {times}")
    assert all(t > 0 for t in times.values())
