"""patches.batch_invariance: a batch of images computed as each image alone (what lets the server batch and
keep every image byte-identical), and undone exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xstage_dit.families import load_pipeline, model_spec
from xstage_dit.runtime.generation import fixed_kwargs, output_pixels, pipeline_kwargs, request_for
from xstage_dit.features.batch_invariance import (NARROW_FEATURES, SMALL_ROWS, SPLIT_ROWS, _padded_linear, _per_prompt,
                                                 batch_invariant, batch_invariant_for)


@pytest.fixture(scope="module")
def tiny_flux():
    pipe = load_pipeline("tiny-flux", seed=0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _images(pipe, n: int, seed: int) -> np.ndarray:
    request = request_for(model_spec("tiny-flux"), prompt="a fox", seed=seed, steps=2, height=32, width=32, n=n)
    return output_pixels(pipe(**pipeline_kwargs(pipe, [request], kind="image", output_type="pt")), "image")


def test_batched_images_equal_single_ones_and_restore_undoes_it(tiny_flux):
    linears = [m for m in tiny_flux.transformer.modules() if type(m) is torch.nn.Linear]
    handle = batch_invariant(tiny_flux)
    try:
        again = batch_invariant(tiny_flux)  # a second caller (the server over the bench's pipeline) shares it
        assert again.describe() == handle.describe()
        again.restore()
        assert "forward" in vars(tiny_flux.text_encoder)  # the first handle still owns the patches
        info = handle.describe()
        assert info["small_row_linears"] == len(linears) > 0 and info["vae_one_image_at_a_time"]
        assert info["per_sample_convs"] == sum(type(m) in (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
                                               for m in tiny_flux.transformer.modules())
        assert set(info["per_prompt_encoders"]) == {"text_encoder", "text_encoder_2"}
        batch = _images(tiny_flux, 3, seed=11)
        singles = np.concatenate([_images(tiny_flux, 1, seed=11 + i) for i in range(3)])
        assert batch.shape == (3, 32, 32, 3) and np.array_equal(batch, singles)
    finally:
        handle.restore()
    handle.restore()  # idempotent
    assert all("forward" not in vars(m) for m in linears)
    assert "forward" not in vars(tiny_flux.text_encoder) and not tiny_flux.vae.use_slicing
    assert not hasattr(tiny_flux, "_xstage_batch_invariance")


@pytest.mark.parametrize("shape", [(1, 24), (3, 24), (2, 5, 24), (SMALL_ROWS, 24), (40, 24), (3, 40, 24),
                                   (2, SPLIT_ROWS, 24), (1, 7, 24)])
def test_padded_linear_is_the_linear(shape):
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(24, 7)
    x = torch.randn(shape, generator=gen)
    got = _padded_linear(layer, x)
    assert got.shape == (*shape[:-1], 7)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias))
    if len(shape) == 3 and shape[0] > 1:
        # a short stream or a narrow layer (7 outputs): each sample's rows are bit for bit its single call's
        for i in range(shape[0]):
            assert torch.equal(got[i:i + 1], _padded_linear(layer, x[i:i + 1]))


@pytest.mark.parametrize("out_features, calls", [(NARROW_FEATURES - 1, 3), (NARROW_FEATURES, 1)])
def test_narrow_linears_run_one_sample_at_a_time(monkeypatch, out_features, calls):
    # FLUX's final proj_out (3072 -> 64) at 512² has 1024 tokens a sample: long, but few output tiles.
    layer = torch.nn.Linear(16, out_features)
    x = torch.randn((3, SPLIT_ROWS, 16), generator=torch.Generator().manual_seed(2))
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    seen = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda a, *rest: seen.append(a.shape[0]) or linear(a, *rest))
    got = _padded_linear(layer, x)
    assert seen == [1] * calls if calls > 1 else seen == [3], seen
    torch.testing.assert_close(got, want)


def test_per_prompt_encoder_merges_model_outputs(tiny_flux):
    encoder = tiny_flux.text_encoder  # CLIP: last_hidden_state, pooler_output, hidden states on request
    ids = torch.randint(0, encoder.config.vocab_size, (3, 77), generator=torch.Generator().manual_seed(1))
    whole = encoder(ids, output_hidden_states=True)
    split = _per_prompt(encoder.forward)(ids, output_hidden_states=True)
    assert type(split) is type(whole) and split.keys() == whole.keys()
    torch.testing.assert_close(split.pooler_output, whole.pooler_output)
    torch.testing.assert_close(split.last_hidden_state, whole.last_hidden_state)
    assert len(split.hidden_states) == len(whole.hidden_states)
    torch.testing.assert_close(split.hidden_states[-2], whole.hidden_states[-2])


# Without the patch, tiny-flux2 (a GEMM) and tiny-hunyuanimage (its patch-embedding Conv2d) differed by one level
# in one channel (CPU, fp32); with it every family is identical.
IMAGE_FAMILIES = ["tiny-nucleusmoe", "tiny-hidream", "tiny-sd3", "tiny-z-image", "tiny-qwenimage", "tiny-qwenimage21",
                  "tiny-flux2", "tiny-hunyuanimage"]


@pytest.mark.parametrize("name", IMAGE_FAMILIES)
def test_other_image_families_batch_as_their_images_alone(name):
    """Every image family's pipeline takes the patch (text encoders: CLIP, T5, Llama with hidden states and
    attentions, Qwen; patch-embedding convolutions): a batch of 2 gives each image's own bytes."""
    pipe = load_pipeline(name, seed=0)
    pipe.set_progress_bar_config(disable=True)
    spec = model_spec(name)
    handle = batch_invariant(pipe)
    try:
        def images(n, seed):
            request = request_for(spec, prompt="a fox", seed=seed, steps=2, n=n)
            return output_pixels(pipe(**pipeline_kwargs(pipe, [request], kind="image", output_type="pt",
                                                         fixed=fixed_kwargs(spec))), "image")

        batch = images(2, 3)
        assert np.array_equal(batch, np.concatenate([images(1, 3), images(1, 4)]))
    finally:
        handle.restore()


def test_batch_invariant_for_patches_images_only(tiny_flux):
    assert batch_invariant_for(tiny_flux, "video") is None and not hasattr(tiny_flux, "_xstage_batch_invariance")
    handle = batch_invariant_for(tiny_flux, "image")
    assert handle is not None and handle.linears > 0 and tiny_flux.vae.use_slicing
    handle.restore()
    with pytest.raises(ValueError, match="'audio'"):
        batch_invariant_for(tiny_flux, "audio")


def test_padded_text_attention_runs_each_sample_at_its_own_text_length():
    """NucleusMoE's attention (image queries over image + padded text keys): each sample alone, its text cut after
    its last real token; the same values as the padded call (masked keys add nothing), one mask read a forward, and
    restore() puts the processors back."""
    from xstage_dit.features.batch_invariance import _TrimmedTextAttention

    pipe = load_pipeline("tiny-nucleusmoe", seed=0)
    blocks = [m for m in pipe.transformer.modules() if hasattr(m, "set_processor")]
    originals = [m.processor for m in blocks]
    handle = batch_invariant(pipe)
    try:
        assert handle.describe()["per_sample_trimmed_attentions"] == len(blocks) > 0
        attn, wrapper = blocks[0], blocks[0].processor
        assert isinstance(wrapper, _TrimmedTextAttention)
        g = torch.Generator().manual_seed(0)
        image, text = 16, 7
        hidden = torch.randn(3, image, pipe.transformer.config.num_attention_heads
                             * pipe.transformer.config.attention_head_dim, generator=g)
        context = torch.randn(3, text, attn.add_k_proj.in_features, generator=g)
        mask = torch.ones(3, image + text, dtype=torch.bool)
        mask[0, image + 4:] = False  # 4 real text tokens, then padding
        mask[2, image + 6:] = False
        half = attn.inner_dim // attn.heads // 2
        rotary = (torch.polar(torch.ones(image, half), torch.rand(image, half, generator=g)),
                  torch.polar(torch.ones(text, half), torch.rand(text, half, generator=g)))
        seen = []
        inner = wrapper.inner
        wrapper.inner = lambda a, h, c, m, r: seen.append((h.shape[0], c.shape[1], m.shape[1])) or inner(a, h, c, m, r)
        with torch.no_grad():
            got = wrapper(attn, hidden, context, mask, rotary)
            want = inner(attn, hidden, context, mask, rotary)
        wrapper.inner = inner
        assert seen == [(1, 4, image + 4), (1, 7, image + 7), (1, 6, image + 6)]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert wrapper._lengths["mask"] is mask and wrapper._lengths["lengths"] == [4, 7, 6]
    finally:
        handle.restore()
    assert [m.processor for m in blocks] == originals


@pytest.mark.parametrize("granularity, per_sample", [("tensor", True), ("row", False)])
def test_fp8_layers_with_one_activation_scale_a_tensor_run_one_sample_at_a_time(monkeypatch, granularity,
                                                                                per_sample):
    """A tensor-wise FP8 layer (torchao: one amax over its whole input) on a long stream: batched, a sample's
    scale would be the batch's; it runs one sample at a time and each sample equals its single call, bit for bit.
    Row-wise (a scale per token) stays batched. On the CPU: torchao's two hardware checks lifted."""
    import torchao.quantization.quant_api as quant_api
    from torchao.quantization import quantize_

    from xstage_dit.features.fp8 import Fp8Config

    monkeypatch.setattr(quant_api, "is_sm_at_least_89", lambda: True)
    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)
    layer = torch.nn.Sequential(torch.nn.Linear(64, NARROW_FEATURES)).to(torch.bfloat16)
    quantize_(layer, Fp8Config(granularity).torchao_config())
    x = torch.randn((2, SPLIT_ROWS, 64), generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    x[1] *= 50.0  # the second sample's amax far above the first's
    seen = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda a, *rest: seen.append(a.shape[0]) or linear(a, *rest))
    got = _padded_linear(layer[0], x)
    assert seen == ([1, 1] if per_sample else [2]), seen
    if per_sample:
        alone = _padded_linear(layer[0], x[:1])
        assert torch.equal(got[:1], alone)
        assert not torch.equal(linear(x, layer[0].weight)[:1], alone)  # batched, sample 0 got the batch's scale
    embeddings = x[:, 0]  # (batch, features): one row a sample, padded to SMALL_ROWS rows
    seen.clear()
    got = _padded_linear(layer[0], embeddings)
    assert seen == ([SMALL_ROWS, SMALL_ROWS] if per_sample else [SMALL_ROWS]), seen
    assert torch.equal(got[:1], _padded_linear(layer[0], embeddings[:1])) or not per_sample
