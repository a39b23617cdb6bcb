"""World-1 attention calls with a key-padding mask or more keys than queries (NucleusMoE's image queries over image +
padded text keys) through the xstage backend (`features.attention_backend`), on the CPU with cuDNN's FP8 kernel
emulated (as in tests/ops/test_attention_fp8_traced.py): they take the compiled cudnn-fp8 path only where FP8
attention was asked for, the mask is a boolean key mask and cudnn-fp8 was measured faster than torch SDPA on masked
inputs (the "-masked" sweep family) or asked for by name; every other call stays diffusers' own SDPA call,
unchanged. And the masked family's cases (`masked_sweep`) on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xstage_dit.features.attention_backend import AttentionContext, xstage_attention
from xstage_dit.features.attention_schedules import AttentionSchedules
from xstage_dit.ops.attention import cudnn_fp8
from xstage_dit.ops.attention import fp8_reference as ref8
from xstage_dit.schedule.facts import DeviceFacts

from tests.features.test_fp8_attention import FakeRefusals, _chooser
from tests.ops.test_attention_fp8_traced import EmulatedCudnnFp8, emulated  # noqa: F401 - the fixture


def _context(fp8_mode: str, timings: dict | None, refuse=()) -> AttentionContext:
    """A world-1 context whose chooser's sweep (a fake) gives ``timings`` for every family, the masked one too."""
    chooser = _chooser(1, timings, FakeRefusals("sdpa", refuse=refuse), fp8_mode)
    book = AttentionSchedules("auto", world=1, facts=DeviceFacts.from_device("cpu"), kernels=chooser)
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


@pytest.mark.parametrize("masked, fp8_mode, timings", [
    (True, "auto", {"sdpa": 1.0, "cudnn-fp8+compiled": 0.6}),
    (False, "auto", {"sdpa": 1.0, "cudnn-fp8+compiled": 0.6}),  # more keys than queries, no mask
    (True, "cudnn-fp8", None),                                     # asked for by name: untimed
])
def test_compiled_with_fp8_attention_a_masked_or_cross_call_takes_cudnn_fp8(emulated, monkeypatch, masked, fp8_mode,
                                                                           timings):
    q, k, v, mask = _inputs()
    mask = mask if masked else None
    ctx = _context(fp8_mode, timings)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    got = xstage_attention(q, k, v, attn_mask=mask, _parallel_config=ctx)
    monkeypatch.undo()
    assert len(emulated.calls) == 1 and emulated.calls[0][0] == (2, 16, 2, 64)
    choice = ctx.schedules.masked_choices[(2, 16, 2, 64, torch.bfloat16)]
    assert choice.name == "cudnn-fp8" and (choice.forced or "0.600 ms" in choice.reason), choice
    if timings:  # the masked family of the one-image shape was the one timed
        assert ctx.schedules.kernels._sweep.calls[-1][0] == "bfloat16-d64-b1-s1024-hr2-p1-fp8-masked"
    want = ref8.cudnn_fp8_emulation(q, k, v, key_mask=mask)
    assert ref8.rel_l2(got, want) < 2e-3, ref8.rel_l2(got, want)
    assert ref8.rel_l2(got, _sdpa(q, k, v, mask)) < 0.1  # FP8 attention's own error (~0.06), masked alike


@pytest.mark.parametrize("fp8_mode, timings, refuse, compiling, float_mask", [
    ("off", {"sdpa": 1.0, "cudnn-fp8+compiled": 0.6}, (), True, False),   # FP8 attention not asked for
    ("auto", {"sdpa": 1.0, "cudnn-fp8+compiled": 0.6}, (), False, False),  # eager: the op's FP8 path takes no mask
    ("auto", {"sdpa": 1.0, "cudnn-fp8+compiled": 1.2}, (), True, False),   # cudnn-fp8 measured slower, masked
    ("auto", {"sdpa": 1.0}, (), True, False),                              # not timed: SDPA keeps it
    ("auto", {"sdpa": 1.0, "cudnn-fp8+compiled": 0.6}, ("cudnn-fp8",), True, False),  # refused at this shape
    ("sage", {"sdpa": 1.0, "cudnn-fp8+compiled": 0.6}, (), True, False),   # SageAttention by name takes no mask
    ("auto", {"sdpa": 1.0, "cudnn-fp8+compiled": 0.6}, (), True, True),    # an additive mask (LTX's -10000 bias)
])
def test_every_other_masked_call_stays_diffusers_sdpa(emulated, monkeypatch, fp8_mode, timings, refuse, compiling,
                                                      float_mask):
    q, k, v, mask = _inputs(1)
    if float_mask:
        mask = torch.where(mask, 0.0, -10000.0).to(torch.bfloat16)
    ctx = _context(fp8_mode, timings, refuse)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    got = xstage_attention(q, k, v, attn_mask=mask, _parallel_config=ctx)
    monkeypatch.undo()
    assert not emulated.calls
    assert torch.equal(got, _sdpa(q, k, v, mask))


def test_the_masked_family_times_masked_sdpa_and_the_padded_fp8_path(monkeypatch):
    """`sweep_cases` on a masked FP8 problem gives `masked_cases`: torch SDPA with a key mask, and the compiled
    cudnn-fp8 path with it where cuDNN's FP8 kernel takes the shape (lifted here; its kernel emulated)."""
    from xstage_dit.ops.attention import masked_sweep
    from xstage_dit.ops.attention.window_path import problem_family, sweep_cases

    problem = dict(batch=1, seq_len=64, heads=2, head_dim=64, world_size=1, dtype=torch.bfloat16,
                   device=torch.device("cpu"), fp8=True, qk_bounded=True, masked=True)
    family = problem_family(**{k: problem[k] for k in ("batch", "seq_len", "heads", "head_dim", "world_size",
                                                       "dtype")}, fp8=True, qk_bounded=True, masked=True)
    assert family == "bfloat16-d64-b1-s1024-hr2-p1-fp8-qkb-masked"
    cases = sweep_cases([problem])
    assert set(cases) == {family} and set(cases[family]) == {"sdpa"}  # cuDNN refuses a CPU: SDPA alone
    cases[family]["sdpa"]()
    kernel = EmulatedCudnnFp8()
    monkeypatch.setattr(cudnn_fp8, "unavailable", lambda device, head_dim: None)
    monkeypatch.setattr(cudnn_fp8, "unavailable_cached", lambda device, head_dim: None)
    monkeypatch.setattr(cudnn_fp8, "shared_attention", lambda: kernel)
    fns = masked_sweep.masked_cases(1, 64, 2, 64, torch.bfloat16, "cpu", qk_bounded=True)
    assert set(fns) == {"sdpa", "cudnn-fp8+compiled"}
    torch._dynamo.reset()
    try:
        fns["cudnn-fp8+compiled"]()
    finally:
        torch._dynamo.reset()
    assert len(kernel.calls) == 1
