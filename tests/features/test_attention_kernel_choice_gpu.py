"""World size 1 on a GPU: a shape where FA4 (or cuDNN, through torch's backend) was chosen runs that kernel
through the patched attention backend and gives torch SDPA's output (diffusers' own call) within bf16 tolerance; the real sweep's choice, eager and
under torch.compile (measured while Dynamo traces), is the one its timings say. Marked `gpu`; skipped visibly
where flash-attn-4 is missing (the `gpu` extra, installed on the device by benchmarks/device.sh fa4-install)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

BF16_TOL = 2e-2
SHAPES = [(2, 4608, 24, 128), (1, 32760, 40, 128)]  # FLUX 1024^2 with CFG batch 2; Wan 2.1 480p x 81 frames


def _fa4_or_skip():
    from xstage_dit.ops.attention import fa4

    reason = fa4.available()
    if reason:
        pytest.skip(f"flash-attn-4 missing: {reason}")


def _context(chooser):
    from xstage_dit.features.attention_backend import AttentionContext
    from xstage_dit.features.attention_schedules import AttentionSchedules
    from xstage_dit.schedule.facts import DeviceFacts

    book = AttentionSchedules("auto", world=1, facts=DeviceFacts.from_device("cuda"), kernels=chooser)
    return AttentionContext(group=None, rank=0, world=1, schedules=book, name="test.attn"), book


def _diffusers_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _chosen_and_run(shape, timings: dict, kernel: str):
    """The world-1 backend with faked sweep timings that make `kernel` the choice; everything after the choice
    is real. Returns (out, q, k, v, ctx) after checking the decision and the output against torch SDPA."""
    from xstage_dit.calibration.kernel_sweep import KernelSweep
    from xstage_dit.features.attention_backend import xstage_attention
    from xstage_dit.features.attention_kernels import KernelChooser

    chooser = KernelChooser(world=1, allow_measure=False, sweep=lambda problem, family, measure: KernelSweep(
        {}, {family: dict(timings)}, "fake"))
    ctx, book = _context(chooser)
    torch.manual_seed(0)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = xstage_attention(q, k, v, _parallel_config=ctx)
    (decision,) = book.choices.values()
    assert decision.name == f"fused:{kernel}" and decision.kernel == kernel, decision
    ref = _diffusers_sdpa(q, k, v)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert not torch.isnan(out).any() and _rel(out, ref) < BF16_TOL
    return out, q, k, v, ctx


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_world1_fa4_chosen_shape_equals_torch_sdpa(shape):
    _fa4_or_skip()
    _chosen_and_run(shape, {"sdpa": 2.0, "fa4": 1.0}, "fa4")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_world1_cudnn_chosen_shape_equals_torch_sdpa(shape):
    """cuDNN through torch's backend (no extra package): the world-1 "fused:cudnn" path, eager and compiled."""
    from xstage_dit.features.attention_backend import xstage_attention

    out, q, k, v, ctx = _chosen_and_run(shape, {"sdpa": 2.0, "fa4": 3.0, "cudnn": 1.0}, "cudnn")
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda q, k, v: xstage_attention(q, k, v, _parallel_config=ctx), fullgraph=True)
        assert torch.equal(compiled(q, k, v), out)  # the same kernel behind the custom op
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
def test_world1_real_sweep_eager_and_compiled_choose_by_the_timings(tmp_path):
    from xstage_dit.features.attention_backend import xstage_attention
    from xstage_dit.features.attention_kernels import KernelChooser

    _fa4_or_skip()
    shape = SHAPES[1]
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def attend(q, k, v, ctx):
        return xstage_attention(q, k, v, _parallel_config=ctx)

    # Compiled first: the sweep is measured while Dynamo traces (real kernels, real timings) and cached.
    traced = KernelChooser(world=1, allow_measure=True, cache_dir=tmp_path)
    ctx_c, book_c = _context(traced)
    torch._dynamo.reset()
    try:
        out_c = torch.compile(attend, backend="eager")(q, k, v, ctx_c)
    finally:
        torch._dynamo.reset()
    (decision_c,) = book_c.choices.values()
    (family,) = traced.report()["families"]
    timings = traced.report()["families"][family]["timings_ms"]
    assert traced.report()["families"][family]["source"] == "measured", timings
    assert set(timings) == {"sdpa", "fa4", "cudnn"}, timings
    best = min(timings, key=timings.get)
    fastest = "serial" if best == "sdpa" else f"fused:{best}"
    assert decision_c.name == fastest, (decision_c, timings)
    # Eager, a new chooser: the cached sweep, the same choice, the same output within bf16.
    cached = KernelChooser(world=1, allow_measure=True, cache_dir=tmp_path)
    ctx_e, book_e = _context(cached)
    out_e = attend(q, k, v, ctx_e)
    (decision_e,) = book_e.choices.values()
    assert cached.report()["families"][family]["source"] == "cache" and decision_e.name == decision_c.name
    ref = _diffusers_sdpa(q, k, v)
    assert _rel(out_c, ref) < BF16_TOL and _rel(out_e, ref) < BF16_TOL
