"""World-1 attention calls with a key-padding mask or more keys than queries (NucleusMoE's image queries over image +
padded text keys) through the xstage backend (`features.attention_backend`), on the CPU with cuDNN's kernels emulated
(as in tests/ops/test_attention_fp8_traced.py): a key-padding mask goes where the masked choice says (the "-masked"
sweep family, timed against torch SDPA with the mask): cuDNN's padded 16-bit kernel, or compiled with FP8 attention
its padded FP8 kernel; more keys than queries without a mask take cudnn-fp8 where the queries' shape chose it,
compiled; every other call stays diffusers' own SDPA call, unchanged. And the masked family's cases
(`masked_sweep`) on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xstage_dit.features.attention_backend import AttentionContext, xstage_attention
from xstage_dit.features.attention_schedules import AttentionSchedules
from xstage_dit.ops.attention import cudnn_fp8, cudnn_padded, masked_sweep
from xstage_dit.ops.attention import fp8_reference as ref8
from xstage_dit.schedule.facts import DeviceFacts

from tests.features.test_fp8_attention import FakeRefusals, _chooser
from tests.ops.test_attention_fp8_traced import EmulatedCudnnFp8, emulated  # noqa: F401 - the fixture

SHAPE = (2, 16, 2, 64, torch.bfloat16)


class EmulatedPadded:
    """What cuDNN's padded 16-bit kernel computes: batch element b attends its first kv_lengths[b] keys (fp32, then
    q's dtype); records the calls."""

    def __init__(self):
        self.calls = []

    def run(self, q, k, v, kv_lengths, scale):
        self.calls.append(tuple(q.shape))
        assert kv_lengths.dtype == torch.int32 and all(t.is_contiguous() for t in (q, k, v))
        past = torch.arange(k.shape[1])[None, :] >= kv_lengths[:, None].long()
        return _reference(q, k, v, ~past, scale).to(q.dtype)


@pytest.fixture
def padded(monkeypatch):
    """cudnn-padded taken on the CPU: its refusal lifted, its kernel emulated."""
    kernel = EmulatedPadded()
    monkeypatch.setattr(cudnn_padded, "shared_padded", lambda: kernel)
    monkeypatch.setattr(cudnn_padded, "unavailable", lambda device, head_dim, dtype: None)
    return kernel


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
    mask[0, 5] = False  # and a key masked mid-sequence: not only right padding
    return q, k, v, mask


def _reference(q, k, v, mask, scale=None):
    """fp32 attention of (B, S, H, D) tensors, a (B, S_k) boolean key mask or None."""
    m = None if mask is None else mask[:, None, None, :]
    return F.scaled_dot_product_attention(q.float().transpose(1, 2), k.float().transpose(1, 2),
                                          v.float().transpose(1, 2), attn_mask=m, scale=scale).transpose(1, 2)


def _sdpa(q, k, v, mask):
    m = None if mask is None else mask[:, None, None, :]
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=m).transpose(1, 2)


def _call(ctx, monkeypatch, q, k, v, mask, compiling):
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: compiling)
        return xstage_attention(q, k, v, attn_mask=mask, _parallel_config=ctx)


@pytest.mark.parametrize("compiling", [False, True])
def test_a_masked_call_takes_the_padded_16bit_kernel_where_it_measured_faster(emulated, padded, monkeypatch,
                                                                             compiling):
    q, k, v, mask = _inputs()
    ctx = _context("off", {"sdpa": 1.0, "cudnn-padded": 0.6})
    got = _call(ctx, monkeypatch, q, k, v, mask, compiling)
    assert padded.calls == [(2, 16, 2, 64)] and not emulated.calls
    choice = ctx.schedules.masked_choices[SHAPE]
    assert choice.name == "cudnn-padded" and "0.600 ms" in choice.reason
    assert ctx.schedules.kernels._sweep.calls[-1][0] == "bfloat16-d64-b1-s1024-hr2-p1-masked"  # the one-image shape
    assert ref8.rel_l2(got, _reference(q, k, v, mask)) < 1e-2  # the masked attention, rounded to bf16 once
    torch._dynamo.reset()
    try:  # compiled for real (Inductor on the CPU): the key gather and the op in one graph
        compiled = torch.compile(lambda q, k, v, m: xstage_attention(q, k, v, attn_mask=m, _parallel_config=ctx),
                                 fullgraph=True)
        assert torch.equal(compiled(q, k, v, mask), got)
    finally:
        torch._dynamo.reset()


def test_compiled_with_fp8_attention_a_masked_call_takes_the_padded_fp8_kernel(emulated, padded, monkeypatch):
    q, k, v, mask = _inputs()
    ctx = _context("auto", {"sdpa": 1.0, "cudnn-padded": 0.8, "cudnn-fp8+compiled": 0.6})
    got = _call(ctx, monkeypatch, q, k, v, mask, compiling=True)
    assert len(emulated.calls) == 1 and emulated.calls[0][0] == (2, 16, 2, 64) and not padded.calls
    assert ctx.schedules.kernels._sweep.calls[-1][0] == "bfloat16-d64-b1-s1024-hr2-p1-fp8-masked"
    want = ref8.cudnn_fp8_emulation(q, k, v, key_mask=mask)
    assert ref8.rel_l2(got, want) < 2e-3, ref8.rel_l2(got, want)  # fp32 sums in another key order: one e4m3 step
    assert ref8.rel_l2(got, _sdpa(q, k, v, mask)) < 0.1  # FP8 attention's own error (~0.06), masked alike
    # by name: taken untimed
    ctx = _context("cudnn-fp8", None)
    _call(ctx, monkeypatch, q, k, v, mask, compiling=True)
    assert len(emulated.calls) == 2 and ctx.schedules.masked_choices[SHAPE].forced


def test_more_keys_than_queries_take_cudnn_fp8_compiled_where_the_queries_shape_chose_it(emulated, monkeypatch):
    q, k, v, _ = _inputs()
    ctx = _context("auto", {"sdpa": 1.0, "cudnn-fp8": 0.5})
    got = _call(ctx, monkeypatch, q, k, v, None, compiling=True)
    assert len(emulated.calls) == 1
    assert ref8.rel_l2(got, ref8.cudnn_fp8_emulation(q, k, v)) < 2e-3
    assert torch.equal(_call(ctx, monkeypatch, q, k, v, None, compiling=False), _sdpa(q, k, v, None))  # eager
    assert len(emulated.calls) == 1
    ctx = _context("off", {"sdpa": 1.0, "cudnn-fp8": 0.5})  # FP8 attention off: nothing decided, SDPA
    assert torch.equal(_call(ctx, monkeypatch, q, k, v, None, compiling=True), _sdpa(q, k, v, None))
    assert not ctx.schedules.choices and not ctx.schedules.kernels._sweep.calls


@pytest.mark.parametrize("fp8_mode, timings, refuse, compiling, float_mask", [
    ("off", {"sdpa": 1.0, "cudnn-padded": 1.2}, (), True, False),                  # the padded kernel slower
    ("off", {"sdpa": 1.0}, (), True, False),                                        # not timed: SDPA keeps it
    ("auto", {"sdpa": 1.0, "cudnn-fp8+compiled": 0.6}, (), False, False),          # eager: no FP8 path takes masks
    ("auto", {"sdpa": 1.0, "cudnn-fp8+compiled": 1.2}, (), True, False),           # cudnn-fp8 measured slower
    ("auto", {"sdpa": 1.0, "cudnn-fp8+compiled": 0.6}, ("cudnn-fp8",), True, False),  # refused at this shape
    ("sage", {"sdpa": 1.0, "cudnn-fp8+compiled": 0.6}, (), True, False),           # SageAttention takes no mask
    ("auto", {"sdpa": 1.0, "cudnn-fp8+compiled": 0.6}, (), True, True),            # an additive mask (LTX's bias)
])
def test_every_other_masked_call_stays_diffusers_sdpa(emulated, monkeypatch, fp8_mode, timings, refuse, compiling,
                                                      float_mask):
    q, k, v, mask = _inputs(1)
    if float_mask:
        mask = torch.where(mask, 0.0, -10000.0).to(torch.bfloat16)
    ctx = _context(fp8_mode, timings, refuse)
    got = _call(ctx, monkeypatch, q, k, v, mask, compiling)
    assert not emulated.calls
    assert torch.equal(got, _sdpa(q, k, v, mask))


def test_on_the_cpu_a_masked_call_is_diffusers_sdpa_with_nothing_timed():
    """cuDNN refuses a CPU: torch SDPA is the only taker, so no sweep runs and the call is diffusers' own."""
    q, k, v, mask = _inputs(2)
    ctx = _context("off", {"sdpa": 1.0, "cudnn-padded": 0.1})
    assert torch.equal(xstage_attention(q, k, v, attn_mask=mask, _parallel_config=ctx), _sdpa(q, k, v, mask))
    choice = ctx.schedules.masked_choices[SHAPE]
    assert choice.name == "sdpa" and "CUDA" in choice.refused["cudnn-padded"]
    assert not ctx.schedules.kernels._sweep.calls


def test_the_masked_family_times_masked_sdpa_and_the_padded_kernels(monkeypatch):
    """`sweep_cases` on a masked problem gives `masked_cases`: torch SDPA with a key mask, and the padded kernels
    where cuDNN takes the shape (lifted here; their kernels emulated)."""
    from xstage_dit.ops.attention.window_path import problem_family, sweep_cases

    problem = dict(batch=1, seq_len=64, heads=2, head_dim=64, world_size=1, dtype=torch.bfloat16,
                   device=torch.device("cpu"), fp8=True, qk_bounded=True, masked=True)
    family = problem_family(**{k: problem[k] for k in ("batch", "seq_len", "heads", "head_dim", "world_size",
                                                       "dtype")}, fp8=True, qk_bounded=True, masked=True)
    assert family == "bfloat16-d64-b1-s1024-hr2-p1-fp8-qkb-masked"
    cases = sweep_cases([problem])
    assert set(cases) == {family} and set(cases[family]) == {"sdpa"}  # cuDNN refuses a CPU: SDPA alone
    cases[family]["sdpa"]()
    fp8, padded16 = EmulatedCudnnFp8(), EmulatedPadded()
    monkeypatch.setattr(cudnn_fp8, "unavailable", lambda device, head_dim: None)
    monkeypatch.setattr(cudnn_fp8, "unavailable_cached", lambda device, head_dim: None)
    monkeypatch.setattr(cudnn_fp8, "shared_attention", lambda: fp8)
    monkeypatch.setattr(cudnn_padded, "unavailable", lambda device, head_dim, dtype: None)
    monkeypatch.setattr(cudnn_padded, "shared_padded", lambda: padded16)
    fns = masked_sweep.masked_cases(1, 64, 2, 64, torch.bfloat16, "cpu", fp8=True, qk_bounded=True)
    assert set(fns) == {"sdpa", "cudnn-padded", "cudnn-fp8+compiled"}
    assert set(masked_sweep.masked_cases(1, 64, 2, 64, torch.bfloat16, "cpu")) == {"sdpa", "cudnn-padded"}
    torch._dynamo.reset()
    try:
        fns["cudnn-fp8+compiled"]()
        fns["cudnn-padded"]()
    finally:
        torch._dynamo.reset()
    assert len(fp8.calls) == 1 and padded16.calls == [(1, 64, 2, 64)]


def test_the_calibration_report_shows_the_masked_choice_per_query_shape():
    """/v1/calibration's kernel section (`server.startup.kernel_report`) lists the masked choices with the reason."""
    from types import SimpleNamespace

    from xstage_dit.server.startup import kernel_report

    q, k, v, mask = _inputs(3)
    ctx = _context("off", {"sdpa": 1.0, "cudnn-padded": 0.1})
    xstage_attention(q, k, v, attn_mask=mask, _parallel_config=ctx)
    handle = SimpleNamespace(attention_kernels=ctx.schedules.kernels, masked_choices=ctx.schedules.masked_choices)
    (shape, shown), = kernel_report(handle)["masked_choices"].items()
    assert "16" in shape and shown["name"] == "sdpa" and "CUDA" in shown["refused"]["cudnn-padded"]
    assert "masked_choices" not in kernel_report(SimpleNamespace(attention_kernels=ctx.schedules.kernels))
