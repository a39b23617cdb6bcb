"""Every built-in family: the tiny pipeline runs end to end on the CPU; the full size has the published
dimensions (checked on the meta device: no memory, no time)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xstage_dit.families import MODELS, load_pipeline, model_spec
from xstage_dit.families.registry import image_inputs_for_model, record, records
from xstage_dit.runtime.conditioning import synthetic_image
from xstage_dit.runtime.generation import call_kwargs, output_pixels, to_pil_frames

TINY = [name for name, spec in MODELS.items() if spec.size == "tiny"]


def test_every_served_family_has_a_tiny_and_a_full_model():
    """A family `generate` / `serve` run (a text-to-image or text-to-video pipeline) has both built-in sizes; the
    Python-only ones (ChronoEdit's edit pipeline, MiniMax-H3's modular one) have none."""
    served = {name for name, r in records().items() if r.served_pipelines}
    assert served >= {"flux", "wan", "hidream", "nucleusmoe", "ltx", "cogvideox", "sd3", "z-image", "wan-vace",
                      "skyreels-v2", "qwenimage", "helios", "flux2", "qwenimage21", "ltx2", "hunyuanvideo",
                      "hunyuanvideo15", "hunyuanimage"}
    for name, r in records().items():
        assert {s.size for s in r.specs} == ({"tiny", "full"} if name in served else set()), name
        # the family's own pipeline is tiny-<family> / full-<family>; a family serving several pipelines
        # (FLUX.1 Kontext, Wan I2V, ...) names the others tiny-<family>... (tiny-flux-kontext, tiny-wan22-i2v)
        plain = {s.name for s in r.specs if not s.variant}
        assert plain == ({f"tiny-{name}", f"full-{name}"} if name in served else set()), name
        assert all(s.name.startswith(f"{s.size}-{name}") for s in r.specs), name


@pytest.mark.parametrize("name", [n for n in TINY if n != "tiny-flux"])  # tiny-flux: tests/test_models.py
def test_tiny_pipeline_runs_end_to_end(name):
    import diffusers

    spec = model_spec(name)
    pipe = load_pipeline(name, seed=0)
    assert type(pipe) is getattr(diffusers, spec.pipeline_class)
    assert spec.pipeline_class in record(spec.family).served_pipelines
    frames_in = 1 + spec.frame_multiple
    small = dict(height=64, width=64, frames=frames_in) if spec.kind == "video" else {}
    facts = image_inputs_for_model(spec)
    if facts is not None and facts.min_images:  # an edit or image-to-video pipeline: its input images (and mask)
        side = small or dict(width=spec.width, height=spec.height)
        small = dict(small, images=[synthetic_image(side["width"], side["height"])] * facts.min_images)
        if facts.mask_argument:
            small["mask"] = synthetic_image(side["width"], side["height"], "L")
    kwargs = lambda: call_kwargs(pipe, spec, prompt="ein Fuchs im Schnee, 東京 🦊", steps=2, seed=1, **small)  # noqa: E731
    out = pipe(**kwargs())
    frames = to_pil_frames(out, spec.kind)  # raises on NaN/inf
    # The server's and `generate`'s path: output_type "pt", rounded as a tensor: the same bytes as "np".
    as_tensor = pipe(**{**kwargs(), "output_type": "pt"})
    assert np.array_equal(output_pixels(as_tensor, spec.kind), output_pixels(out, spec.kind))
    if spec.kind == "image":
        assert len(frames) == 1
    elif spec.family == "wan":
        assert len(frames) == frames_in
    else:  # CogVideoX pads its latent frames, Helios makes whole windows: more frames than asked for
        assert len(frames) >= frames_in
    pixels = np.stack([np.asarray(f) for f in frames])
    assert pixels.std() > 1.0  # not a constant image
    if spec.kind == "image":
        assert frames[0].size == (spec.width, spec.height)
    else:
        assert frames[0].size == (64, 64)


def test_hidream_keeps_its_pixel_area():
    """HiDream's pipeline rescales requests to a fixed area; the tiny model's area is its default size."""
    spec = model_spec("tiny-hidream")
    pipe = load_pipeline("tiny-hidream")
    out = pipe(**call_kwargs(pipe, spec, prompt="a fox", steps=1, height=64, width=256))
    assert to_pil_frames(out, "image")[0].size == (256, 64)


def test_wan_video_frame_rule():
    spec = model_spec("tiny-wan")
    spec.check_size(64, 64, 9)
    with pytest.raises(ValueError, match="got 8"):
        spec.check_size(64, 64, 8)


# Parameter counts (billions) of the components of the full-size pipelines: the published sizes (the comment's
# rounded figure) of the checkpoint each family record names.
FULL_PARAMS = {
    "full-flux": {"transformer": 11.90, "text_encoder": 0.123, "text_encoder_2": 4.76},  # FLUX.1-dev, CLIP-L, T5-XXL
    # FLUX.1-Kontext-dev: FLUX.1-dev's transformer and text encoders
    "full-flux-kontext": {"transformer": 11.90, "text_encoder": 0.123, "text_encoder_2": 4.76},
    # FLUX.1-Fill-dev: the same blocks over 384 input channels (11.90B)
    "full-flux-fill": {"transformer": 11.90, "text_encoder": 0.123, "text_encoder_2": 4.76},
    "full-wan": {"transformer": 14.29, "text_encoder": 5.68},  # Wan2.1-T2V-14B, UMT5-XXL
    # Wan2.1-I2V-14B-480P (16.4B: the image key/value projections of 40 blocks), UMT5-XXL, CLIP ViT-H/14 (0.63B)
    "full-wan-i2v": {"transformer": 16.39, "text_encoder": 5.68, "image_encoder": 0.631},
    "full-sana": {"transformer": 1.604, "text_encoder": 2.614},  # Sana_1600M_1024px, Gemma-2-2B
    "full-lumina2": {"transformer": 2.610, "text_encoder": 2.614},  # Lumina-Image-2.0, Gemma-2-2B
    # HiDream-I1-Full (17B), CLIP-L, CLIP-G, T5-XXL, Llama-3.1-8B
    "full-hidream": {"transformer": 17.11, "text_encoder": 0.124, "text_encoder_2": 0.695, "text_encoder_3": 4.76,
                     "text_encoder_4": 8.03},
    "full-nucleusmoe": {"transformer": 16.92, "text_encoder": 8.77},  # Nucleus-Image (17B), Qwen3-VL-8B
    "full-ltx": {"transformer": 1.92, "text_encoder": 4.76},  # LTX-Video 0.9 (2B), T5-XXL
    "full-cogvideox": {"transformer": 5.57, "text_encoder": 4.76},  # CogVideoX-5b, T5-XXL
    # SD3.5 Large (8.1B), CLIP-L, CLIP-G, T5-XXL
    "full-sd3": {"transformer": 8.06, "text_encoder": 0.124, "text_encoder_2": 0.695, "text_encoder_3": 4.76},
    "full-z-image": {"transformer": 6.15, "text_encoder": 4.02},  # Z-Image-Turbo (6B), Qwen3-4B
    "full-wan-vace": {"transformer": 17.34, "text_encoder": 5.68},  # Wan2.1-VACE-14B (14B + VACE blocks), UMT5-XXL
    "full-skyreels-v2": {"transformer": 14.29, "text_encoder": 5.68},  # SkyReels-V2-DF-14B, UMT5-XXL
    "full-qwenimage": {"transformer": 20.43, "text_encoder": 8.29},  # Qwen-Image (20B), Qwen2.5-VL-7B
    "full-helios": {"transformer": 14.31, "text_encoder": 5.68},  # Helios-Base (14B), UMT5-XXL
    "full-flux2": {"transformer": 32.22, "text_encoder": 23.34},  # FLUX.2-dev (32B), Mistral-Small-3.2-24B
    "full-qwenimage21": {"transformer": 7.12, "text_encoder": 8.77},  # Qwen-Image-2.1 (class defaults), Qwen3-VL-8B
    # LTX-2 (19B: 14B video + 5B audio), Gemma-3-12B
    "full-ltx2": {"transformer": 18.88, "text_encoder": 12.20},
    "full-hunyuanvideo": {"transformer": 12.82, "text_encoder": 7.50, "text_encoder_2": 0.123},  # HunyuanVideo (13B)
    # HunyuanVideo-1.5 (8.3B), Qwen2.5-VL-7B's language model, ByT5-small
    "full-hunyuanvideo15": {"transformer": 8.33, "text_encoder": 7.07, "text_encoder_2": 0.218},
    # HunyuanImage-2.1 (17B), Qwen2.5-VL-7B, ByT5-small
    "full-hunyuanimage": {"transformer": 17.43, "text_encoder": 8.29, "text_encoder_2": 0.218},
}


def test_every_full_model_is_counted():
    assert set(FULL_PARAMS) == {name for name, spec in MODELS.items() if spec.size == "full"}


@pytest.mark.parametrize("name", sorted(FULL_PARAMS))
def test_full_pipelines_have_published_sizes(name):
    """The whole full-size pipeline, built on the meta device (architecture only: no memory, no time)."""
    pipe = load_pipeline(name, dtype=torch.bfloat16, device="meta")
    for component, billions in FULL_PARAMS[name].items():
        count = sum(p.numel() for p in getattr(pipe, component).parameters()) / 1e9
        assert count == pytest.approx(billions, rel=0.01), component


def test_full_moe_shapes_are_the_published_ones():
    from xstage_dit.families import hidream, nucleusmoe

    h = hidream.build_transformer("full", dtype=torch.bfloat16, device="meta")
    assert (h.config.num_routed_experts, h.config.num_activated_experts) == (4, 2)
    assert h.config.num_attention_heads * h.config.attention_head_dim == 2560
    assert len(h.config.llama_layers) == h.config.num_layers + h.config.num_single_layers
    n = nucleusmoe.build_transformer("full", dtype=torch.bfloat16, device="meta")
    assert (n.config.num_experts, n.config.moe_intermediate_dim, n.config.num_layers) == (64, 1344, 32)
    assert n.config.num_attention_heads * n.config.attention_head_dim == 2048


def test_plain_tensor_attributes_go_to_the_cpu_parameters_and_buffers_stay():
    """A build on the GPU puts tensors a module holds as plain attributes on the CPU, where from_pretrained +
    .to(device) leaves them (fake CUDA tensors here: no GPU needed, no data moved)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from xstage_dit.families.build import _plain_tensors_to_cpu

    class Rope(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(4, 4))
            self.register_buffer("scale", torch.empty(4))
            self.pos_freqs = torch.empty(8)  # a plain attribute, as NucleusMoE's and QwenImage's rope tables

    with FakeTensorMode():
        with torch.device("cuda"):  # what build_module does on a GPU
            model = torch.nn.Sequential(Rope())
        assert model[0].pos_freqs.device.type == "cuda"
        _plain_tensors_to_cpu(model)
    rope = model[0]
    assert rope.pos_freqs.device.type == "cpu" and tuple(rope.pos_freqs.shape) == (8,)
    assert rope.weight.device.type == "cuda" and rope.scale.device.type == "cuda"


@pytest.mark.gpu
def test_on_the_gpu_a_built_pipeline_keeps_plain_tensor_attributes_on_the_cpu():
    from xstage_dit.families import load_pipeline

    pipe = load_pipeline("tiny-nucleusmoe", dtype=torch.bfloat16, device=torch.device("cuda"), seed=0)
    rope = pipe.transformer.pos_embed
    assert rope.pos_freqs.device.type == "cpu" and rope.neg_freqs.device.type == "cpu"
    assert next(pipe.transformer.parameters()).is_cuda


def test_build_module_rejects_empty_parameters():
    from xstage_dit.families.build import build_module

    with pytest.raises(ValueError, match="non-empty"):
        build_module(lambda: torch.nn.Linear(4, 0), seed=0, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="floating"):
        build_module(lambda: torch.nn.Linear(4, 4), seed=0, device="cpu", dtype=torch.int8)


def test_parameters_left_uninitialized_get_a_seeded_init():
    """Classes that leave weights to the checkpoint loader (torch.empty) still get finite, seeded weights."""
    from xstage_dit.families.build import build_module

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up = torch.nn.Parameter(torch.empty(3, 16, 8))  # experts x in x out, never initialized
            self.bias = torch.nn.Parameter(torch.empty(8))
            self.proj = torch.nn.Linear(16, 4)  # initialized by its class

    def make(seed):
        return build_module(Experts, seed=seed, device="cpu", dtype=torch.float32)

    a, b, c = make(0), make(0), make(1)
    assert torch.isfinite(a.gate_up).all() and a.gate_up.std() > 0.1  # ~ 1/sqrt(16)
    assert torch.equal(a.bias, torch.zeros(8))
    for x, y in ((a.gate_up, b.gate_up), (a.proj.weight, b.proj.weight)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert not torch.equal(a.gate_up, c.gate_up)
    assert a.proj.weight.abs().max() <= 1 / 16**0.5  # nn.Linear's own (uniform) init was kept


def test_nucleusmoe_expert_weights_are_initialized():
    pipe = load_pipeline("tiny-nucleusmoe", seed=0)
    experts = [m for m in pipe.transformer.modules() if type(m).__name__ == "SwiGLUExperts"]
    assert experts
    for m in experts:
        for p in m.parameters():
            assert torch.isfinite(p).all() and p.std() > 0


@pytest.mark.parametrize("name", TINY)
def test_load_transformer_matches_the_pipeline(name):
    from xstage_dit.families import load_transformer

    alone = load_transformer(name, seed=4)
    in_pipe = load_pipeline(name, seed=4).transformer
    assert type(alone) is type(in_pipe)
    for (n, a), (_, b) in zip(alone.state_dict().items(), in_pipe.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    with pytest.raises(ValueError, match="dtype"):
        load_transformer(name, dtype=torch.int64)


def test_hunyuan_video_template_crops_exactly_its_own_tokens():
    """crop_start must drop the template's prefix (bos + the text before the prompt) and nothing of the prompt."""
    from xstage_dit.families.hunyuan_video import PROMPT_TEMPLATE
    from xstage_dit.families.tokenizers import llama_tokenizer

    tok = llama_tokenizer()
    prefix = tok(PROMPT_TEMPLATE["template"].split("{}")[0]).input_ids
    full = tok(PROMPT_TEMPLATE["template"].format("a red fox")).input_ids
    assert PROMPT_TEMPLATE["crop_start"] == len(prefix) and full[:len(prefix)] == prefix


def test_hunyuan_video_i2v_template_counts_the_in_code_llava_tokenizer():
    """HunyuanVideo I2V's template: crop_start drops the prefix (and nothing of the prompt), <image> sits at
    image_emb_start and the vision tower makes image_emb_len tokens for it, and the assistant header the pipeline
    cuts (4 tokens) is 4 tokens."""
    from xstage_dit.families.hunyuan_video import I2V_PROMPT_TEMPLATE as template

    pipe = load_pipeline("tiny-hunyuanvideo-i2v")
    tok, vision = pipe.tokenizer, pipe.text_encoder.config.vision_config
    prefix = tok(template["template"].split("{}")[0]).input_ids
    full = tok(template["template"].format("a red fox")).input_ids
    assert template["crop_start"] == len(prefix) and full[:len(prefix)] == prefix
    assert prefix.index(pipe.text_encoder.config.image_token_index) == template["image_emb_start"]
    assert template["image_emb_len"] == (vision.image_size // vision.patch_size) ** 2
    assert template["image_emb_end"] == template["image_emb_start"] + template["image_emb_len"]
    header = "<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
    assert len(tok(header, add_special_tokens=False).input_ids) == 4
    assert tok.padding_side == "right"  # the pipeline crops the template from the front of every row


@pytest.mark.parametrize("name", ["tiny-hunyuanvideo15", "tiny-hunyuanimage"])
def test_hunyuan_template_crop_is_counted_for_the_in_code_tokenizer(name):
    """The pipeline crops its prompt template's first ``prompt_template_encode_start_idx`` tokens (a literal for
    the real tokenizer, counted in code for the tiny model): the whole system prefix and nothing of the prompt."""
    pipe = load_pipeline(name)
    tok, crop = pipe.tokenizer, pipe.prompt_template_encode_start_idx
    if name == "tiny-hunyuanvideo15":
        def ids(prompt):
            messages = [{"role": "system", "content": pipe.system_message}, {"role": "user", "content": prompt}]
            return tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    else:
        def ids(prompt):
            return tok(pipe.prompt_template_encode.format(prompt)).input_ids
    first, second = ids("a red fox"), ids("photo of a cat")
    assert crop > 34 and first[:crop] == second[:crop]  # the same prefix whatever the prompt ...
    assert first[crop] != second[crop]  # ... and the first token after it is the prompt's own
    assert tok.decode(first[crop:]).startswith("a red fox")


def test_hunyuan_glyph_text_reaches_the_byt5_encoder():
    """A quoted text in the prompt becomes valid ByT5 tokens (the glyph stream); a prompt without one, none."""
    pipe = load_pipeline("tiny-hunyuanimage")
    _, _, embeds_2, mask_2 = pipe.encode_prompt(['a sign that says "open"', "a red fox"], device="cpu", batch_size=2)
    assert mask_2.shape == (2, pipe.tokenizer_2_max_length)
    assert mask_2[0].sum() == len('Text "open". ') + 1 and mask_2[1].sum() == 0  # the bytes + </s>; nothing
    assert embeds_2[0].abs().sum() > 0 and embeds_2[1].abs().sum() == 0
