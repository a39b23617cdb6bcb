"""The bounds on |q| and |k| read off the q/k norms (`features/qk_bounds.py`) on tiny FLUX and Wan, on the CPU:
every attention call of a denoising step gets them, they are never below the true amax (with the norms' weights
spread out, biases and all), the world-1 cudnn-fp8 path takes its q and k scales from them (cuDNN's kernel replaced
by its fp32 emulation, as in tests/ops/test_attention_fp8_traced.py), and compiled regionally the blocks still share
one graph per block class (the weights enter as graph inputs: no recompile per block)."""

from __future__ import annotations

import pytest
import torch

import xstage_dit.ops.attention as attention_ops
from xstage_dit.families import load_pipeline, model_spec
from xstage_dit.runtime.generation import call_kwargs
from xstage_dit.features import ParallelConfig, parallelize
from xstage_dit.features.qk_bounds import amax_bound, qk_norms
from xstage_dit.ops.attention import cudnn_fp8
from xstage_dit.ops.attention.fp8_reference import E4M3_MAX, po2_scale

from tests.ops.test_attention_fp8_traced import EmulatedCudnnFp8


class Recorder:
    """Stands in for ``cudnn_fp8_attention`` inside ``ulysses_attention``: records q's and k's amax and the bounds
    handed in, then runs the real path."""

    def __init__(self, real):
        self.real, self.calls, self.masked = real, [], 0

    def __call__(self, q, k, v, scale=None, amax_bounds=None, key_mask=None):
        bounds = None if amax_bounds is None else tuple(float(b) for b in amax_bounds)
        self.calls.append((float(q.float().abs().amax()), float(k.float().abs().amax()), bounds))
        self.masked += key_mask is not None
        return self.real(q, k, v, scale=scale, amax_bounds=amax_bounds, key_mask=key_mask)


@pytest.fixture
def emulated_fp8(monkeypatch):
    """cudnn-fp8 taken on the CPU: its refusal lifted, its kernel emulated."""
    monkeypatch.setattr(cudnn_fp8, "unavailable", lambda device, head_dim: None)
    monkeypatch.setattr(cudnn_fp8, "unavailable_cached", lambda device, head_dim: None)
    kernel = EmulatedCudnnFp8()
    monkeypatch.setattr(cudnn_fp8, "shared_attention", lambda: kernel)
    return kernel


@pytest.fixture
def fp8_path(emulated_fp8, monkeypatch):
    """`emulated_fp8`, each call recorded (the compiled branch of ``ulysses_attention`` taken eagerly, so the
    recorder sees values)."""
    recorder = Recorder(attention_ops.cudnn_fp8_attention)
    monkeypatch.setattr(attention_ops, "cudnn_fp8_attention", recorder)
    return recorder


def _spread_norm_weights(transformer, gen):
    """Norm weights far from their init (ones), some large, so that the bound is tested, not just its slack."""
    with torch.no_grad():
        for module in transformer.modules():
            if type(module).__name__ == "RMSNorm" and getattr(module, "weight", None) is not None:
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 1.5)


def _step(pipe, spec):
    kwargs = call_kwargs(pipe, spec, prompt="a fox in the snow", seed=3, steps=1, height=64, width=64)
    with torch.inference_mode():
        return pipe(**{**kwargs, "output_type": "latent"})


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-wan", "tiny-qwenimage", "tiny-hidream", "tiny-nucleusmoe"])
def test_every_call_gets_bounds_at_or_above_the_true_amax(fp8_path, monkeypatch, model):
    pipe, spec = load_pipeline(model, dtype=torch.bfloat16, device="cpu", seed=0), model_spec(model)
    _spread_norm_weights(pipe.transformer, torch.Generator().manual_seed(1))
    handle = parallelize(pipe.transformer, ParallelConfig(schedule="auto"))
    try:
        handle.attention_kernels.use_fp8_attention("cudnn-fp8")
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        _step(pipe, spec)
    finally:
        monkeypatch.undo()
        handle.restore()
    assert fp8_path.calls, "no attention call took the cudnn-fp8 path"
    for q_amax, k_amax, bounds in fp8_path.calls:
        assert bounds is not None, "an attention call got no bounds"
        # bf16 rounding of the normed values may pass the bound by a few ulps: the cast saturates there
        assert q_amax <= bounds[0] * (1 + 2 ** -6) and k_amax <= bounds[1] * (1 + 2 ** -6), (q_amax, k_amax, bounds)
        assert bounds[0] < 64 * q_amax  # and not uselessly loose: within a few binades of the true amax


def test_the_bound_is_sqrt_n_times_the_largest_weight_plus_bias():
    from diffusers.models.normalization import RMSNorm

    norm = RMSNorm(128, eps=1e-6, elementwise_affine=True, bias=True)
    with torch.no_grad():
        norm.weight.fill_(0.5).view(-1)[7] = -3.0
        norm.bias.fill_(0.25)
    assert float(amax_bound((norm,))) == pytest.approx(128 ** 0.5 * 3.0 + 0.25)
    plain = torch.nn.RMSNorm((4, 16), elementwise_affine=False)
    assert float(amax_bound((plain, norm))) == pytest.approx(128 ** 0.5 * 3.0 + 0.25)
    assert float(amax_bound((plain,))) == pytest.approx(8.0)
    # Any input: the normed rows never pass the bound
    x = torch.randn(64, 128) * torch.logspace(-3, 3, 64)[:, None]
    assert float(norm(x).abs().amax()) <= float(amax_bound((norm,))) * (1 + 1e-6)
    # And the scale from it leaves the largest value inside e4m3's range
    assert float(amax_bound((norm,)) * po2_scale(amax_bound((norm,)))) <= E4M3_MAX


def test_only_the_processors_read_here_get_bounds():
    from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor

    attn = FluxAttention(query_dim=64, heads=2, dim_head=32, added_kv_proj_dim=64)
    q_norms, k_norms = qk_norms(attn, FluxAttnProcessor())
    assert q_norms == (attn.norm_q, attn.norm_added_q) and k_norms == (attn.norm_k, attn.norm_added_k)
    assert qk_norms(attn, object()) is None  # another processor: it may do anything between the norm and SDPA
    assert qk_norms(attn, type("FluxAttnProcessor", (), {})()) is None  # a user's class of the same name
    attn.norm_added_q = None
    assert qk_norms(attn, FluxAttnProcessor()) is None  # a stream left unnormed
    del attn.norm_added_q, attn.norm_added_k
    assert qk_norms(attn, FluxAttnProcessor()) == ((attn.norm_q,), (attn.norm_k,))  # a stream the module lacks
    attn.norm_q = torch.nn.LayerNorm(32)
    assert qk_norms(attn, FluxAttnProcessor()) is None  # a LayerNorm's output is not bounded by its weights


def _compiled_step(pipe, spec) -> tuple[torch.Tensor, int]:
    """One regionally compiled step (Dynamo's eager backend): (latents, graphs compiled)."""
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    try:
        pipe.transformer.compile_repeated_blocks(backend="eager", fullgraph=True, dynamic=False)
        before = dynamo_utils.counters["stats"]["unique_graphs"]
        latents = _step(pipe, spec).images
        return latents, dynamo_utils.counters["stats"]["unique_graphs"] - before
    finally:
        torch._dynamo.reset()


def test_compiled_blocks_compile_no_more_graphs_than_bf16_and_equal_eager(emulated_fp8, monkeypatch):
    """Two blocks a class, each with its own norm weights (bounds): as many graphs as the bf16 stack compiles (one a
    block class, and one more where the first single-stream block's input has other strides), none per block."""
    import copy

    pipe, spec = load_pipeline("tiny-flux", dtype=torch.bfloat16, device="cpu", seed=0), model_spec("tiny-flux")
    for blocks in (pipe.transformer.transformer_blocks, pipe.transformer.single_transformer_blocks):
        blocks.append(copy.deepcopy(blocks[0]))
    _spread_norm_weights(pipe.transformer, torch.Generator().manual_seed(2))
    bf16 = parallelize(pipe.transformer, ParallelConfig(schedule="auto"))
    try:
        _, bf16_graphs = _compiled_step(pipe, spec)
    finally:
        bf16.restore()
    assert not emulated_fp8.calls
    handle = parallelize(pipe.transformer, ParallelConfig(schedule="auto"))
    try:
        handle.attention_kernels.use_fp8_attention("cudnn-fp8")
        with monkeypatch.context() as m:
            m.setattr(torch.compiler, "is_compiling", lambda: True)
            eager = _step(pipe, spec).images
        eager_calls = len(emulated_fp8.calls)
        compiled, fp8_graphs = _compiled_step(pipe, spec)
    finally:
        handle.restore()
    assert eager_calls == 4 and len(emulated_fp8.calls) == 8  # every block's attention took the FP8 path, both times
    assert fp8_graphs == bf16_graphs <= 3, (fp8_graphs, bf16_graphs)
    assert torch.equal(compiled, eager)


def test_the_sweep_times_the_bounded_form_only_where_every_layer_has_bounds():
    from tests.features.test_fp8_attention import FLUX, FakeRefusals, _chooser

    flux = parallelize(load_pipeline("tiny-flux", dtype=torch.bfloat16, device="cpu", seed=0).transformer,
                       ParallelConfig(schedule="auto"))
    sd3 = parallelize(load_pipeline("tiny-sd3", dtype=torch.bfloat16, device="cpu", seed=0).transformer,
                      ParallelConfig(schedule="auto"))
    try:
        assert flux.attention_kernels.qk_bounded is True
        assert sd3.attention_kernels.qk_bounded is False  # SD3's joint processor is not one read here
    finally:
        flux.restore()
        sd3.restore()
    chooser = _chooser(1, {"sdpa": 1.0}, FakeRefusals("sdpa", "cudnn"), "auto")
    chooser.note_qk_bounds(True)
    chooser.choose(**FLUX, device=torch.device("cpu"))
    chooser.note_qk_bounds(False)  # a second transformer without bounds: the form without them from now on
    chooser._sweeps.clear()
    chooser.choose(**FLUX, device=torch.device("cpu"))
    assert [family for family, _ in chooser._sweep.calls] == ["bfloat16-d128-b1-s8192-hr24-p1-fp8-qkb",
                                                             "bfloat16-d128-b1-s8192-hr24-p1-fp8"]


def test_a_weightless_norm_bound_lands_on_the_device_asked_for():
    from diffusers.models.normalization import RMSNorm

    weighted, plain = RMSNorm(64, eps=1e-6), RMSNorm(16, eps=1e-6, elementwise_affine=False)
    bound = amax_bound((plain, weighted), "meta")
    assert bound.device.type == "meta" and bound.dim() == 0
