"""World-1 cudnn-fp8 with its casts in torch (``ops/attention/fp8_traced.py``) on the CPU, cuDNN's kernel replaced by
an fp32 emulation of what it computes from e4m3 inputs: the quantizer equals its definition bit for bit (eager and
compiled by Inductor), the whole path equals ``fp8_reference.cudnn_fp8_emulation`` bit for bit (so the scale slots
handed to the kernel and the output's descale are the eager path's), ``ulysses_attention`` takes it only under
``torch.compile`` at world 1, and a compiled stack chooses cudnn-fp8 by its compiled time."""

from __future__ import annotations

import pytest
import torch

from xstage_dit.ops.attention import cudnn_fp8, ulysses_attention
from xstage_dit.ops.attention import fp8_reference as ref8
from xstage_dit.ops.attention.fp8_quant import DESCALE_K, DESCALE_Q, DESCALE_V, SCALE_O
from xstage_dit.ops.attention.fp8_traced import cudnn_fp8_attention, quantize_scaled
from xstage_dit.schedule.attention_kernel import as_compiled


class EmulatedCudnnFp8:
    """What cuDNN's FP8 forward computes from its e4m3 inputs and scale slots (``fp8_reference``'s emulation after
    its quantization step), in fp32 on any device; records the calls."""

    def __init__(self):
        self.calls = []

    def run(self, x, attn_scale, kv_lengths=None):
        self.calls.append((tuple(x.q.shape), x.scales.data_ptr() % 16, x.q.is_contiguous()))
        qf, kf, vf = ((t.float().transpose(1, 2) * x.slot(s)) for t, s in ((x.q, DESCALE_Q), (x.k, DESCALE_K),
                                                                            (x.v, DESCALE_V)))
        s = (qf @ kf.transpose(-1, -2)) * attn_scale
        if kv_lengths is not None:  # cuDNN's padding mask: batch element b attends its first kv_lengths[b] keys
            assert kv_lengths.dtype == torch.int32 and kv_lengths.shape == (x.q.shape[0],)
            past = torch.arange(x.k.shape[1])[None, :] >= kv_lengths[:, None].long()
            s = s.masked_fill(past[:, None, None, :], float("-inf"))
        p = torch.exp(s - s.amax(dim=-1, keepdim=True))
        o = ((p * ref8.P_SCALE).to(ref8.E4M3).float() / ref8.P_SCALE @ vf) / p.sum(dim=-1, keepdim=True)
        return (o * x.slot(SCALE_O)).to(ref8.E4M3).transpose(1, 2).contiguous()


@pytest.fixture
def emulated(monkeypatch):
    kernel = EmulatedCudnnFp8()
    monkeypatch.setattr(cudnn_fp8, "shared_attention", lambda: kernel)
    monkeypatch.setattr(cudnn_fp8, "unavailable_cached", lambda device, head_dim: None)
    return kernel


def _awkward(gen, shape, amax):
    x = torch.randn(shape, generator=gen) * amax
    x.view(-1)[3] = amax  # the largest magnitude exactly: a power of two or 448 * 2**k lands on a scale boundary
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("amax", [448.0, 0.875, 1.0, 3.9, 2.0 ** -7, 5e4])
def test_the_quantizer_is_its_definition_eager_and_compiled(amax):
    x = _awkward(torch.Generator().manual_seed(1), (2, 37, 3, 64), amax)
    want8, descale = ref8.quantize_reference(x)
    for fn in (quantize_scaled, torch.compile(quantize_scaled, fullgraph=True, dynamic=False)):
        got8, scale = fn(x)
        assert got8.dtype == ref8.E4M3 and got8.is_contiguous()
        assert torch.equal(got8.view(torch.uint8), want8.view(torch.uint8)), amax
        assert scale.item() * descale.item() == 1.0
    zeros8, scale = quantize_scaled(torch.zeros(3, 5, dtype=torch.bfloat16))
    assert torch.isfinite(scale) and not zeros8.float().any()


@pytest.mark.parametrize("shape_q, shape_kv, dtype", [
    ((1, 64, 4, 128), (1, 64, 4, 128), torch.bfloat16),
    ((2, 37, 3, 64), (2, 37, 3, 64), torch.float16),      # odd length, head_dim 64, batch 2
    ((1, 19, 2, 128), (1, 45, 2, 128), torch.bfloat16),   # more keys than queries
])
def test_the_path_equals_the_emulation_bit_for_bit_eager_and_compiled(emulated, shape_q, shape_kv, dtype):
    gen = torch.Generator().manual_seed(2)
    q = (torch.randn(shape_q, generator=gen) * 3).to(dtype)
    k, v = ((torch.randn(shape_kv, generator=gen) * s).to(dtype) for s in (0.5, 20.0))
    want = ref8.cudnn_fp8_emulation(q, k, v)
    got = cudnn_fp8_attention(q, k, v)
    assert got.dtype == dtype and got.shape == q.shape and torch.equal(got, want)
    compiled = torch.compile(cudnn_fp8_attention, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(q, k, v, scale=0.1), ref8.cudnn_fp8_emulation(q, k, v, scale=0.1))
    # Every scale slot reached the kernel 16-byte aligned, and e4m3 inputs contiguous (cuDNN's BSHD strides).
    assert emulated.calls and all(align == 0 and contiguous for _, align, contiguous in emulated.calls)


def test_a_strided_input_quantizes_to_contiguous_e4m3(emulated):
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(1, 40, 3, 4, 64, generator=gen).to(torch.bfloat16)
    q, k, v = qkv.unbind(2)  # (B, S, H, D) views with a row stride of 3 * H * D
    assert torch.equal(cudnn_fp8_attention(q, k, v), ref8.cudnn_fp8_emulation(q, k, v))


def test_the_op_refuses_a_device_cudnn_fp8_cannot_run_on_naming_why():
    x8 = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16).to(ref8.E4M3)
    with pytest.raises(ValueError, match=r"cudnn-fp8 refuses q of \(1, 8, 2, 64\) on cpu: .*CUDA"):
        torch.ops.xstage_dit.cudnn_fp8_sdpa(x8, x8, x8, torch.ones(8, 4), 0.125)


def test_bad_inputs_are_named():
    x = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"expected q, k, v of one dtype, bfloat16 or float16, got torch.float32"):
        cudnn_fp8_attention(x.float(), x.float(), x.float())
    with pytest.raises(ValueError, match=r"expected q \(B, Sq, H, D\) and k, v \(B, Skv, H, D\), got \(1, 8, 2, 64\), "
                                         r"\(1, 8, 3, 64\)"):
        cudnn_fp8_attention(x, torch.zeros(1, 8, 3, 64, dtype=torch.bfloat16), x)


def test_ulysses_attention_takes_the_path_only_compiled_at_world_one(emulated):
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 48, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(3))

    def attend(q, k, v):
        return ulysses_attention(q, k, v, schedule="fused:cudnn-fp8")

    got = torch.compile(attend, fullgraph=True, dynamic=False)(q, k, v)
    assert torch.equal(got, ref8.cudnn_fp8_emulation(q, k, v)) and len(emulated.calls) == 1
    # Eager: the op's own path (Triton quantizers, the peer-window store), which refuses a CPU tensor, naming why.
    with pytest.raises(ValueError, match="cudnn-fp8 refuses this problem"):
        attend(q, k, v)


def test_a_compiled_stack_chooses_cudnn_fp8_by_its_compiled_time():
    from tests.features.test_fp8_attention import FLUX, FakeRefusals, _chooser

    timings = {"sdpa": 0.41, "cudnn": 0.40, "cudnn-fp8": 0.57, "cudnn-fp8+compiled": 0.36}
    assert as_compiled(timings) == {"sdpa": 0.41, "cudnn": 0.40, "cudnn-fp8": 0.36}
    assert as_compiled(None) is None and as_compiled({}) == {}
    chooser = _chooser(1, timings, FakeRefusals("sdpa", "cudnn"), "auto")
    assert chooser.choose(**FLUX, device=torch.device("cpu")).name == "cudnn"  # eager: the eager path's time
    chooser = _chooser(1, timings, FakeRefusals("sdpa", "cudnn"), "auto")
    undo = chooser.for_compile()
    choice = chooser.choose(**FLUX, device=torch.device("cpu"))
    assert choice.name == "cudnn-fp8" and "0.360 ms" in choice.reason
    undo()
    assert not chooser.compiled


def test_bounds_known_in_advance_set_q_and_k_scales_and_saturate_past_them(emulated):
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 40, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    amax_q, amax_k = q.float().abs().amax(), k.float().abs().amax()
    exact = ref8.cudnn_fp8_emulation(q, k, v)
    # the true amax as the bound: the per-call scales, so the same output bit for bit
    assert torch.equal(cudnn_fp8_attention(q, k, v, amax_bounds=(amax_q, amax_k)), exact)
    # a looser bound (four binades up) costs nothing: e4m3 rounds alike in every binade, only values 2**-6 below
    # the largest turn subnormal (here the bf16 outputs came out equal)
    loose = cudnn_fp8_attention(q, k, v, amax_bounds=(amax_q * 16, amax_k * 16))
    assert ref8.rel_l2(loose, exact) < 1e-3
    # a bound below the values (never handed in by features.qk_bounds): saturated at e4m3's largest, not NaN
    q8, _ = quantize_scaled(q, amax_q / 8)
    assert torch.isfinite(q8.float()).all() and q8.float().abs().amax() == ref8.E4M3_MAX


def test_in_block_timings_stand_for_the_kernel_at_sdpas_time_plus_its_cost_over_sdpa_in_a_block():
    timings = {"sdpa": 0.40, "cudnn": 0.39, "cudnn-fp8": 0.84, "cudnn-fp8+compiled": 0.395,
               "sdpa+in-block": 0.52, "cudnn-fp8+in-block": 0.46}
    got = as_compiled(timings)
    assert set(got) == {"sdpa", "cudnn", "cudnn-fp8"} and got["sdpa"] == 0.40 and got["cudnn"] == 0.39
    assert got["cudnn-fp8"] == pytest.approx(0.34)  # 0.40 + (0.46 - 0.52): the in-block difference wins
    # without sdpa's in-block timing (its compile failed): the kernel's own compiled time, as before
    del timings["sdpa+in-block"]
    assert as_compiled(timings)["cudnn-fp8"] == 0.395 and "cudnn-fp8+in-block" not in as_compiled(timings)


@pytest.mark.parametrize("bounded", [False, True])
def test_the_in_block_cases_compile_and_compute_the_same_attention(emulated, bounded):
    """The sweep's in-block closures (`window_path._in_block_cases`) on the CPU, cuDNN's kernel emulated: both compile
    whole (fullgraph), the FP8 block is the emulation of the same producer -> attention -> consumer, and it is within
    FP8's error of the SDPA block."""
    from xstage_dit.ops.attention.window_path import _PRODUCER_GAIN, _in_block_cases

    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 64, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    torch._dynamo.reset()
    try:
        cases = _in_block_cases(q, k, v, 64 ** -0.5, qk_bounded=bounded)
        assert set(cases) == {"cudnn-fp8+in-block", "sdpa+in-block"}
        fp8, bf16 = cases["cudnn-fp8+in-block"](), cases["sdpa+in-block"]()
    finally:
        torch._dynamo.reset()
    g = _PRODUCER_GAIN
    # Inductor folds the producer into the cast: q * gain in fp32, never rounded to bf16 first (exact here: 1.25 = 5/4)
    want = ref8.cudnn_fp8_emulation(q.float() * g, k.float() * g, v) * g
    assert fp8.shape == bf16.shape == q.shape and len(emulated.calls) == 1
    assert ref8.rel_l2(fp8, want) < 1e-3, ref8.rel_l2(fp8, want)  # bit for bit on the CPU (0.0)
    assert ref8.rel_l2(fp8, bf16) < 0.1  # FP8 attention's own error (~0.06) against the 16-bit block


def _key_mask(batch, seq_k, kept, kind):
    """bool (batch, seq_k): the first ``kept[b]`` keys (right padding, NucleusMoE's text) or every key but a
    scattered few (``kind`` "scattered")."""
    mask = torch.arange(seq_k)[None, :] < torch.tensor(kept)[:, None]
    if kind == "scattered":
        mask = torch.ones(batch, seq_k, dtype=torch.bool)
        mask[0, 3::7] = False
        mask[-1, 1:5] = False
    return mask


@pytest.mark.parametrize("kind, mask_shape", [("right", (2, 1, 1, 45)), ("scattered", (2, 45)), ("one", (1, 45))])
def test_a_key_padding_mask_is_attended_as_masked_softmax_eager_and_compiled(emulated, kind, mask_shape):
    """A key-padding mask becomes per-sample key lengths over the kept keys moved first: the emulated kernel (cuDNN's
    padding mask) equals the masked emulation (fp32 sums in another order: within one e4m3 step of O), and the mask
    matters (far from the unmasked output)."""
    gen = torch.Generator().manual_seed(7)
    q = (torch.randn(2, 19, 2, 64, generator=gen) * 3).to(torch.bfloat16)
    k, v = ((torch.randn(2, 45, 2, 64, generator=gen) * s).to(torch.bfloat16) for s in (0.5, 20.0))
    mask = _key_mask(2, 45, [40, 33], kind)[: mask_shape[0]].reshape(mask_shape)
    want = ref8.cudnn_fp8_emulation(q, k, v, key_mask=mask)
    unmasked = ref8.cudnn_fp8_emulation(q, k, v)
    for fn in (cudnn_fp8_attention, torch.compile(cudnn_fp8_attention, fullgraph=True, dynamic=False)):
        got = fn(q, k, v, key_mask=mask)
        assert got.shape == q.shape and ref8.rel_l2(got, want) < 2e-3, ref8.rel_l2(got, want)
        assert ref8.rel_l2(got, unmasked) > 0.05
    assert len(emulated.calls) == 2


def test_kept_keys_first_moves_the_kept_keys_first_in_order_and_counts_them():
    from xstage_dit.ops.attention.key_padding import kept_keys_first

    k = torch.arange(2 * 6 * 1 * 2, dtype=torch.float32).reshape(2, 6, 1, 2)
    mask = torch.tensor([[True, False, True, True, False, True], [False] * 5 + [True]])
    k2, v2, lengths = kept_keys_first(k, -k, mask)
    assert lengths.tolist() == [4, 1] and lengths.dtype == torch.int32
    assert k2[0, :, 0, 0].tolist() == [0, 4, 6, 10, 2, 8] and k2[1, 0, 0, 0] == k[1, 5, 0, 0]
    assert torch.equal(v2, -k2)
    for bad in (mask.float(), mask[:, :5], mask.reshape(2, 1, 6), torch.ones(3, 6, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"expected a bool key mask \(B \| 1, Skv\) or \(B \| 1, 1, 1, Skv\) "
                                             r"with B=2, Skv=6, got"):
            kept_keys_first(k, k, bad)
