"""World-1 attention calls with a key-padding mask or more keys than queries (NucleusMoE's image queries over image +
padded text keys) through the xstage backend (`features.attention_backend`), on the CPU with cuDNN's FP8 kernel
emulated (as in tests/ops/test_attention_fp8_traced.py): they take the compiled cudnn-fp8 path only where FP8
attention was asked for, the shape's schedule is cudnn-fp8 and the mask is a boolean key mask; every other call
stays diffusers' own SDPA call, unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xstage_dit.features.attention_backend import AttentionContext, xstage_attention
from xstage_dit.features.attention_schedules import AttentionSchedules
from xstage_dit.ops.attention import cudnn_fp8
from xstage_dit.ops.attention import fp8_reference as ref8
from xstage_dit.schedule.attention_kernel import AttentionDecision
from xstage_dit.schedule.facts import DeviceFacts

from tests.features.test_fp8_attention import FakeRefusals, _chooser
from tests.ops.test_attention_fp8_traced import EmulatedCudnnFp8


@pytest.fixture
def emulated(monkeypatch):
    kernel = EmulatedCudnnFp8()
    monkeypatch.setattr(cudnn_fp8, "shared_attention", lambda: kernel)
    monkeypatch.setattr(cudnn_fp8, "unavailable_cached", lambda device, head_dim: None)
    return kernel


def _context(fp8_mode: str, schedule: str, fp8_ms: float | None = None) -> AttentionContext:
    """A world-1 context whose queries' self-attention shape (2, 16, 2, 64) was decided as ``schedule``, the sweep
    having timed torch SDPA at 1.0 ms and cudnn-fp8 at ``fp8_ms`` (None: not timed)."""
    chooser = _chooser(1, {"sdpa": 1.0}, FakeRefusals("sdpa"), fp8_mode)
    book = AttentionSchedules("auto", world=1, facts=DeviceFacts.from_device("cpu"), kernels=chooser)
    timings = {"sdpa": 1.0, "cudnn": 0.8, **({} if fp8_ms is None else {"cudnn-fp8": fp8_ms})}
    kernel = schedule.partition(":")[2] or None
    book.choices[(2, 16, 2, 64, torch.bfloat16, 1)] = AttentionDecision(schedule, "test", kernel, "test", timings,
                                                                         {}, 1.0)
    return AttentionContext(group=None, rank=0, world=1, schedules=book, name="test.attn")


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 16, 2, 64, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(2, 24, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    mask = torch.arange(24)[None, :] < torch.tensor([24, 19])[:, None]  # (B, S_k): the second sample's text padded
    return q, k, v, mask


def _sdpa(q, k, v, mask):
    m = None if mask is None else mask[:, None, None, :]
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=m).transpose(1, 2)


@pytest.mark.parametrize("masked, schedule, fp8_ms", [
    (True, "fused:cudnn-fp8", 0.5),
    (False, "fused:cudnn-fp8", 0.5),  # more keys than queries, no mask
    (True, "fused:cudnn", 0.9),       # a 16-bit kernel chosen, but cudnn-fp8 measured under torch SDPA (1.0)
])
def test_compiled_with_fp8_attention_a_masked_or_cross_call_takes_cudnn_fp8(emulated, monkeypatch, masked, schedule,
                                                                           fp8_ms):
    q, k, v, mask = _inputs()
    mask = mask if masked else None
    ctx = _context("auto", schedule, fp8_ms)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    got = xstage_attention(q, k, v, attn_mask=mask, _parallel_config=ctx)
    monkeypatch.undo()
    assert len(emulated.calls) == 1 and emulated.calls[0][0] == (2, 16, 2, 64)
    want = ref8.cudnn_fp8_emulation(q, k, v, key_mask=mask)
    assert ref8.rel_l2(got, want) < 2e-3, ref8.rel_l2(got, want)
    assert ref8.rel_l2(got, _sdpa(q, k, v, mask)) < 0.1  # FP8 attention's own error (~0.06), masked alike


@pytest.mark.parametrize("fp8_mode, schedule, fp8_ms, compiling, float_mask", [
    ("off", "fused:cudnn-fp8", 0.5, True, False),    # FP8 attention not asked for
    ("auto", "fused:cudnn-fp8", 0.5, False, False),  # eager: the op's eager FP8 path takes no mask
    ("auto", "fused:cudnn", 1.2, True, False),       # cudnn-fp8 measured slower than torch SDPA
    ("auto", "fused:cudnn", None, True, False),      # cudnn-fp8 not timed (refused)
    ("auto", "serial", None, True, False),
    ("auto", "fused:cudnn-fp8", 0.5, True, True),    # an additive mask (LTX's -10000 bias) is not a key padding
])
def test_every_other_masked_call_stays_diffusers_sdpa(emulated, monkeypatch, fp8_mode, schedule, fp8_ms, compiling,
                                                      float_mask):
    q, k, v, mask = _inputs(1)
    if float_mask:
        mask = torch.where(mask, 0.0, -10000.0).to(torch.bfloat16)
    ctx = _context(fp8_mode, schedule, fp8_ms)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    got = xstage_attention(q, k, v, attn_mask=mask, _parallel_config=ctx)
    monkeypatch.undo()
    assert not emulated.calls
    assert torch.equal(got, _sdpa(q, k, v, mask))
