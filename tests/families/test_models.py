"""Offline pipelines: real diffusers classes, random weights, in-code tokenizers, no download."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xstage_dit.families import MODELS, load_pipeline, model_spec
from xstage_dit.runtime.generation import call_kwargs, save_output, to_pil_frames
from xstage_dit.families.spec import ModelSpec


@pytest.fixture(scope="module")
def tiny_flux():
    return load_pipeline("tiny-flux", seed=0)


def _image(pipe, spec, prompt="a red fox in the snow", seed=0, **kw):
    out = pipe(**call_kwargs(pipe, spec, prompt=prompt, seed=seed, **kw))
    return out.images[0]


def test_tiny_flux_is_the_real_pipeline(tiny_flux):
    from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    assert isinstance(tiny_flux, FluxPipeline)
    assert isinstance(tiny_flux.transformer, FluxTransformer2DModel)
    assert isinstance(tiny_flux.vae, AutoencoderKL)
    assert isinstance(tiny_flux.text_encoder, CLIPTextModel)
    assert isinstance(tiny_flux.text_encoder_2, T5EncoderModel)
    assert tiny_flux.transformer.config.guidance_embeds
    # The patch multiple in the spec is the pipeline's own rule (VAE factor x 2x2 packing).
    assert model_spec("tiny-flux").patch_multiple == tiny_flux.vae_scale_factor * 2


def test_tiny_flux_generates_deterministic_images(tiny_flux):
    spec = model_spec("tiny-flux")
    a = _image(tiny_flux, spec, seed=1, height=64, width=96, steps=2)
    b = _image(tiny_flux, spec, seed=1, height=64, width=96, steps=2)
    c = _image(tiny_flux, spec, seed=2, height=64, width=96, steps=2)
    assert a.shape == (64, 96, 3)
    assert np.isfinite(a).all() and a.std() > 1e-3  # not a constant image
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() > 1e-3


def test_same_seed_same_weights_other_seed_other_weights():
    from xstage_dit.families.flux import build_transformer

    w0 = build_transformer("tiny", dtype=torch.float32, device="cpu", seed=0).proj_out.weight
    w0b = build_transformer("tiny", dtype=torch.float32, device="cpu", seed=0).proj_out.weight
    w1 = build_transformer("tiny", dtype=torch.float32, device="cpu", seed=1).proj_out.weight
    torch.testing.assert_close(w0, w0b, rtol=0, atol=0)
    assert not torch.equal(w0, w1)


@pytest.mark.parametrize("prompt", ["Zürich im Schnee, café", "東京の夜景", "🦊 fox ✓", "x" * 600])
def test_non_ascii_and_long_prompts(tiny_flux, prompt):
    img = _image(tiny_flux, model_spec("tiny-flux"), prompt=prompt, steps=1, height=32, width=32)
    assert np.isfinite(img).all()


def test_tokenizers_cover_any_text_and_stay_in_vocab():
    from xstage_dit.families import tokenizers as T

    text = "A photo of a cat, Zürich 東京 🦊"
    clip = T.clip_tokenizer()
    ids = clip(text).input_ids
    assert ids[0] == clip.bos_token_id and ids[-1] == clip.eos_token_id
    decoded = clip.decode(ids, skip_special_tokens=True)  # byte-level: lossless up to case and CLIP's word gaps
    assert decoded.replace(" ", "") == text.lower().replace(" ", "")
    qwen = T.qwen_tokenizer()
    assert qwen.decode(qwen(text).input_ids) == text
    llama = T.llama_tokenizer()  # byte fallback
    assert llama.decode(llama(text, add_special_tokens=False).input_ids) == text
    t5 = T.t5_tokenizer()
    ids = t5(text).input_ids
    assert ids[-1] == t5.eos_token_id and t5.unk_token_id in ids  # unknown characters -> <unk>
    assert t5.pad_token_id == 0 and t5.eos_token_id == 1
    # Common words are single tokens, not character soup.
    assert len(t5("a photo of a cat", add_special_tokens=False).input_ids) == 5
    assert len(qwen(" photo").input_ids) == 1


def test_model_spec_registry_and_errors():
    for name, spec in MODELS.items():
        assert spec.name == name and spec.size in ("tiny", "full")
        spec.check_size(spec.height, spec.width, spec.frames)
    with pytest.raises(ValueError, match="nope"):
        model_spec("nope")
    spec = model_spec("tiny-flux")
    with pytest.raises(ValueError, match="100"):
        spec.check_size(100, 64)
    with pytest.raises(ValueError, match="got 0"):
        spec.check_size(64, 0)
    with pytest.raises(ValueError, match="frames"):
        spec.check_size(64, 64, 5)
    with pytest.raises(ValueError, match="kind"):
        ModelSpec(name="x", family="flux", size="tiny", kind="audio", pipeline_class="P",
                  patch_multiple=16, height=64, width=64, steps=1, guidance=1.0)


def test_call_kwargs_validation(tiny_flux):
    spec = model_spec("tiny-flux")
    kw = call_kwargs(tiny_flux, spec, prompt="x")
    assert (kw["height"], kw["width"], kw["num_inference_steps"]) == (spec.height, spec.width, spec.steps)
    with pytest.raises(ValueError, match="steps >= 1, got 0"):
        call_kwargs(tiny_flux, spec, prompt="x", steps=0)
    with pytest.raises(ValueError, match="guidance >= 0, got -1"):
        call_kwargs(tiny_flux, spec, prompt="x", guidance=-1)
    with pytest.raises(ValueError, match="prompt"):
        call_kwargs(tiny_flux, spec, prompt="  ")
    with pytest.raises(ValueError, match="dtype"):
        load_pipeline("tiny-flux", dtype=torch.int32)


def test_local_folder_loads_with_the_same_call(tiny_flux, tmp_path):
    tiny_flux.save_pretrained(tmp_path / "my-flux")
    folder = str(tmp_path / "my-flux")
    spec = model_spec(folder)
    assert (spec.family, spec.size, spec.pipeline_class) == ("flux", "local", "FluxPipeline")
    pipe = load_pipeline(folder)
    kw = dict(steps=2, height=32, width=32, seed=3)
    np.testing.assert_allclose(_image(pipe, spec, **kw), _image(tiny_flux, spec, **kw), atol=1e-5)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    with pytest.raises(ValueError, match="StableDiffusionPipeline"):
        model_spec(str(tmp_path / "other"))


def test_save_output_image_grid_and_video(tmp_path):
    from PIL import Image

    frames = [Image.fromarray(np.full((16, 24, 3), 20 * i, np.uint8)) for i in range(5)]
    grid = Image.open(save_output(frames, tmp_path / "g.png", kind="video"))
    assert grid.size == (3 * 24, 2 * 16)
    mp4 = save_output(frames, tmp_path / "v.mp4", kind="video", fps=8)
    import imageio.v3 as iio

    assert iio.imread(mp4).shape[0] == 5  # frames read back
    with pytest.raises(ValueError, match="v.mp4"):
        save_output(frames[:1], tmp_path / "v.mp4", kind="image")
    with pytest.raises(ValueError, match="gif"):
        save_output(frames, tmp_path / "v.gif", kind="video")


def test_to_pil_frames_rejects_nan():
    class Out:
        images = np.full((1, 8, 8, 3), np.nan, np.float32)

    with pytest.raises(ValueError, match="NaN"):
        to_pil_frames(Out(), "image")


def test_full_flux_has_the_published_dimensions():
    """Built on the meta device: architecture only, no memory, no time."""
    from xstage_dit.families.flux import build_transformer

    model = build_transformer("full", dtype=torch.bfloat16, device="meta")
    cfg = model.config
    assert (len(model.transformer_blocks), len(model.single_transformer_blocks)) == (19, 38)
    assert (cfg.num_attention_heads, cfg.attention_head_dim, cfg.joint_attention_dim) == (24, 128, 4096)
    assert cfg.pooled_projection_dim == 768 and cfg.guidance_embeds
    num_params = sum(p.numel() for p in model.parameters())
    assert 11.8e9 < num_params < 12.0e9  # FLUX.1-dev: 11.9B


@pytest.mark.gpu
def test_tiny_flux_on_gpu_bf16():
    pipe = load_pipeline("tiny-flux", dtype=torch.bfloat16, device="cuda", seed=0)
    img = _image(pipe, model_spec("tiny-flux"))
    assert img.shape == (128, 128, 3) and np.isfinite(img).all() and img.std() > 1e-3


@pytest.mark.gpu
def test_full_flux_transformer_step_on_gpu_bf16():
    """One denoising step of the 12B transformer at 1024^2 (4096 image + 512 text tokens)."""
    from xstage_dit.families.flux import build_transformer
    from xstage_dit.families.flux_inputs import transformer_inputs

    model = build_transformer("full", dtype=torch.bfloat16, device="cuda", seed=0)
    inputs = transformer_inputs(model.config, height=1024, width=1024, text_tokens=512, dtype=torch.bfloat16,
                                device="cuda", seed=0)
    out = model(**inputs, return_dict=False)[0]
    assert out.shape == inputs["hidden_states"].shape == (1, 4096, 64)
    assert torch.isfinite(out).all() and out.float().std() > 0


def test_every_xstage_generation_runs_under_inference_mode(tiny_flux):
    """run_pipeline is how the server, `generate` and the bench's xstage contenders call a pipeline: inference
    mode (diffusers' own call only disables grad), with the same image as the plain call."""
    from xstage_dit.bench import contenders
    from xstage_dit.runtime.generation import run_pipeline
    from xstage_dit.server import runner

    seen = []

    class Probe:
        def __call__(self, **kwargs):
            seen.append(torch.is_inference_mode_enabled())
            return kwargs

    assert run_pipeline(Probe(), x=1) == {"x": 1} and seen == [True]
    assert runner.run_pipeline is run_pipeline and contenders.run_pipeline is run_pipeline
    spec = model_spec("tiny-flux")
    kwargs = lambda: call_kwargs(tiny_flux, spec, prompt="a fox", seed=3, steps=2, height=32, width=32)  # noqa: E731
    np.testing.assert_array_equal(run_pipeline(tiny_flux, **kwargs()).images, tiny_flux(**kwargs()).images)


def test_pixels_rounded_as_tensors_equal_the_numpy_rule():
    """The server and `generate` round the decoded tensor where it is (output_type "pt"); the bytes must be those
    of the numpy rule on diffusers' "np" floats, at the rounding boundaries too, from float32 and bf16."""
    from xstage_dit.runtime.generation import to_uint8, to_uint8_tensor

    k = torch.arange(256, dtype=torch.float32)
    edges = (k + 0.5) / 255.0
    values = torch.cat([edges, torch.nextafter(edges, torch.zeros(())), torch.nextafter(edges, torch.ones(())),
                        k / 255.0, torch.tensor([-1.0, -0.0, 0.0, 1.0, 1.5, 255.0]), torch.rand(100_000) * 1.2 - 0.1])
    assert np.array_equal(to_uint8_tensor(values).numpy(), to_uint8(values.numpy()))
    half = values.bfloat16()
    assert np.array_equal(to_uint8_tensor(half).numpy(), to_uint8(half.float().numpy()))


@pytest.mark.parametrize("kind", ["image", "video"])
def test_output_pixels_of_pt_and_np_outputs_agree(kind):
    from types import SimpleNamespace

    from xstage_dit.runtime.generation import output_pixels

    gen = torch.Generator().manual_seed(0)
    shape = (2, 3, 5, 7) if kind == "image" else (2, 4, 3, 5, 7)  # channels first, as diffusers' "pt"
    pt = torch.rand(shape, generator=gen) * 1.1 - 0.05
    channels_last = (0, 2, 3, 1) if kind == "image" else (0, 1, 3, 4, 2)
    as_np = pt.permute(*channels_last).numpy()
    out = lambda data: SimpleNamespace(images=data, frames=data)  # noqa: E731
    got = output_pixels(out(pt), kind)
    assert got.dtype == np.uint8 and got.shape == as_np.shape
    assert np.array_equal(got, output_pixels(out(as_np), kind))
    bad = pt.clone()
    bad.view(-1)[3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        output_pixels(out(bad), kind)
    with pytest.raises(ValueError, match="channels first"):
        output_pixels(out(pt[0]), kind)


def test_tiny_flux_pt_output_gives_the_np_images(tiny_flux):
    """A real pipeline's "pt" output, rounded as a tensor, is the "np" output's image byte for byte."""
    from xstage_dit.runtime.generation import output_pixels, pipeline_kwargs, request_for, to_uint8

    spec = model_spec("tiny-flux")
    request = request_for(spec, prompt="a fox", seed=5, steps=2, height=32, width=48)
    got = {t: tiny_flux(**pipeline_kwargs(tiny_flux, [request], kind="image", output_type=t)) for t in ("pt", "np")}
    assert isinstance(got["pt"].images, torch.Tensor)
    assert np.array_equal(output_pixels(got["pt"], "image"), to_uint8(np.asarray(got["np"].images)))
    with pytest.raises(ValueError, match="output_type"):
        pipeline_kwargs(tiny_flux, [request], kind="image", output_type="pil")
