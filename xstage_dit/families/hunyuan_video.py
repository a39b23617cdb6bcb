"""HunyuanVideo text-to-video (`HunyuanVideoPipeline`): tiny (1 dual + 1 single block, 4 heads x 16, a 3-layer
Llama text encoder (the pipeline reads the hidden state 3rd from the end) over the in-code Llama tokenizer, a
CLIP text encoder for the pooled prompt, the HunyuanVideo VAE with 3 levels: 4x spatial, 4x temporal; random
weights, CPU seconds) and full (HunyuanVideo dimensions, diffusers' class defaults: the 13B transformer, 20 dual
+ 40 single blocks, 24 heads x 128; llava-llama-3-8b's language model and CLIP-L; the HunyuanVideo VAE).

The pipeline wraps the prompt in a chat template and drops its first ``crop_start`` tokens: the real
template's 95 are for the real tokenizer, so `PROMPT_TEMPLATE` carries the count for the in-code one
(the registry passes it as ``prompt_template``). It pads the prompt and passes its mask; guidance is embedded
(one call per step), true CFG with a negative prompt is a second call. The record: our plan (image and text split
after their embedders; the token refiner attends the whole prompt before the split; blocks get the text mask
rebuilt from the shards), paired CFG.

Image-to-video (`HunyuanVideoImageToVideoPipeline`, HunyuanVideo-I2V): the text encoder is LLaVA (llava-llama-3-8b:
a CLIP ViT-L/14-336 tower whose 576 image tokens take the place of ``<image>`` in the prompt template); the
pipeline keeps every 4th of them in front of the prompt's tokens, so the image enters the text sequence (split
with it). The transformer is the "token_replace" one: the first latent frame is the image's latents, and its
tokens get a modulation of their own (timestep 0) in every block, which the blocks apply to their first
``first_frame_num_tokens`` tokens; our plan hands each rank the count of first-frame tokens in its own shard.
(HunyuanVideo-I2V-33ch, "latent_concat": the image's latents and a mask concatenated on channels, shard with the
latents; no built-in model of it.)
"""

from __future__ import annotations

import torch

from xstage_dit import _diffusers_private as private
from xstage_dit.families import sharding
from xstage_dit.families.build import build_module, check_vocab, clip_image_processor
from xstage_dit.families.flux import CLIP
from xstage_dit.families.record import FamilyRecord, ImageInputFacts, SequenceParallelFacts, SizeLimits
from xstage_dit.families.sp_plan import PlanHook, SequenceParallelSpec
from xstage_dit.families.spec import ModelSpec
from xstage_dit.families.tokenizers import clip_tokenizer, llama_tokenizer

TEXT = {
    # llava-llama-3-8b's language model
    "full": dict(vocab_size=128320, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5),
    "tiny": dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                     num_key_value_heads=1, max_position_embeddings=1024)}

TRANSFORMER = {
    "full": dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
                 num_single_layers=40, num_refiner_layers=2, text_embed_dim=TEXT["full"]["hidden_size"],
                 pooled_projection_dim=CLIP["full"]["hidden_size"], rope_axes_dim=(16, 56, 56)),
    "tiny": dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=1,
                 num_single_layers=1, num_refiner_layers=1, text_embed_dim=TEXT["tiny"]["hidden_size"],
                 pooled_projection_dim=CLIP["tiny"]["hidden_size"], rope_axes_dim=(4, 6, 6)),
}

# HunyuanVideo-I2V: the first frame's tokens modulated apart (in_channels 16, guidance embedded)
TRANSFORMER["tiny-i2v"] = dict(TRANSFORMER["tiny"], image_condition_type="token_replace")

# the LLaVA text encoder's vision tower (llava-llama-3-8b: CLIP ViT-L/14-336, 576 image tokens); the pipeline keeps
# every 4th of its image tokens
VISION = {"tiny": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                       patch_size=8, projection_dim=16, hidden_act="gelu")}

VAE = {"full": dict(),  # the class defaults: HunyuanVideo's VAE (16 latent channels, 8x spatial, 4x temporal)
       "tiny": dict(latent_channels=4, block_out_channels=(8, 8, 8), layers_per_block=1, norm_num_groups=4,
                    down_block_types=("HunyuanVideoDownBlock3D",) * 3, up_block_types=("HunyuanVideoUpBlock3D",) * 3,
                    spatial_compression_ratio=4, temporal_compression_ratio=4, mid_block_add_attention=False)}

# A shorter system prompt than the real template's; crop_start = bos + the tokens before "{}" under the in-code
# Llama tokenizer (tests/families/test_models_families.py recounts it)
PROMPT_TEMPLATE = {
    "template": "<|start_header_id|>system<|end_header_id|>\n\nDescribe the video.<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>",
    "crop_start": 83,
}


# The image-to-video template: the real one's layout (``<image>`` in the system turn, the assistant header after the
# prompt) with a shorter system prompt; its counts are for the in-code LLaVA tokenizer (the test recounts them):
# crop_start = the tokens before "{}", image_emb_start = the position of <image>, 16 image tokens (32 / 8 squared).
I2V_PROMPT_TEMPLATE = {
    "template": "<|start_header_id|>system<|end_header_id|>\n\n<image>\nDescribe the video from the image.<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
                "\n\n",
    "crop_start": 30, "image_emb_start": 9, "image_emb_end": 25, "image_emb_len": 16,
}

VARIANTS = ("", "i2v")  # text-to-video, HunyuanVideo-I2V


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0, variant: str = ""):
    from diffusers import HunyuanVideoTransformer3DModel

    config = TRANSFORMER[f"{size}-{variant}" if variant else size]
    return build_module(lambda: HunyuanVideoTransformer3DModel(**config), seed=seed, device=device, dtype=dtype)


def _llava(size: str, tokenizer, *, dtype: torch.dtype, device, seed: int):
    """HunyuanVideo I2V's text encoder: LLaVA (the Llama of `TEXT` and the CLIP tower of `VISION`), random weights."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    pad = tokenizer.pad_token_id
    config = LlavaConfig(vision_config=CLIPVisionConfig(**VISION[size]),
                         text_config=LlamaConfig(**TEXT[size], pad_token_id=pad),
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"), pad_token_id=pad,
                         projector_hidden_act="gelu")
    return build_module(lambda: LlavaForConditionalGeneration(config), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int, variant: str = ""):
    import diffusers
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    if variant not in VARIANTS:
        raise ValueError(f"expected a HunyuanVideo variant in {VARIANTS}, got {variant!r}")
    tokenizer, tokenizer_2 = llama_tokenizer(1024, llava=variant == "i2v"), clip_tokenizer()
    check_vocab(tokenizer, TEXT[size]["vocab_size"], "Llama")
    check_vocab(tokenizer_2, CLIP[size]["vocab_size"], "CLIP")
    if variant == "i2v":
        text_encoder = _llava(size, tokenizer, dtype=dtype, device=device, seed=seed + 1)
        extra = dict(image_processor=clip_image_processor(VISION[size]["image_size"]))
    else:
        text_encoder = build_module(lambda: LlamaModel(LlamaConfig(**TEXT[size])), seed=seed + 1, device=device,
                                    dtype=dtype)
        extra = {}
    pipeline = diffusers.HunyuanVideoImageToVideoPipeline if variant else diffusers.HunyuanVideoPipeline
    return pipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed, variant=variant),
        vae=build_module(lambda: AutoencoderKLHunyuanVideo(**VAE[size]), seed=seed + 2, device=device, dtype=dtype),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=build_module(lambda: CLIPTextModel(CLIPTextConfig(**CLIP[size])), seed=seed + 3, device=device,
                                    dtype=dtype),
        tokenizer_2=tokenizer_2,
        **extra,
    )


# ---- the record ---------------------------------------------------------------------------------------------

class _MaskRoot(PlanHook):
    """Records the text padding mask at entry; None when every text token is real (one check per forward)."""

    def pre_forward(self, module, *args, **kwargs):
        mask = kwargs.get("encoder_attention_mask", args[3] if len(args) > 3 else None)
        self.state.named["text_mask"] = None if mask is None or bool(mask.bool().all()) else mask.bool()
        return args, kwargs


class _BlockMask(PlanHook):
    """Blocks get a mask built from local lengths; replace it by [image shard ones, text mask shard]."""

    def pre_forward(self, module, hidden_states, encoder_hidden_states, temb, attention_mask=None, *rest, **kwargs):
        text_mask = self.state.named.get("text_mask")
        if text_mask is None:
            attention_mask = None
        else:
            local_text = sharding.shard(text_mask, 1, self.state.rank, self.state.world)
            ones = torch.ones(hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
            attention_mask = torch.cat([ones, local_text], dim=1)[:, None, None, :]
        return (hidden_states, encoder_hidden_states, temb, attention_mask, *rest), kwargs


class _TokenReplaceRoot(_MaskRoot):
    """token_replace (HunyuanVideo-I2V): also records the whole latent sequence's length, from the (batch, channels,
    frames, height, width) input."""

    def pre_forward(self, module, *args, **kwargs):
        latents = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        p, p_t = module.config.patch_size, module.config.patch_size_t
        frames, height, width = latents.shape[2:]
        self.state.named["latent_tokens"] = (frames // p_t) * (height // p) * (width // p)
        return super().pre_forward(module, *args, **kwargs)


class _TokenReplaceBlock(_BlockMask):
    """token_replace blocks modulate their first ``num_tokens`` tokens apart (the first latent frame: the input
    image). The model hands them the whole sequence's count; on a shard it becomes how many of this rank's tokens
    (from its offset under the split rule) are first-frame ones: 0 .. the shard's length."""

    POSITION = 6  # (hidden, encoder hidden, temb, mask, rotary, token_replace_emb, num_tokens)

    def pre_forward(self, module, *args, **kwargs):
        args, kwargs = super().pre_forward(module, *args, **kwargs)
        whole = kwargs["num_tokens"] if "num_tokens" in kwargs else args[self.POSITION]
        start = sharding.split_offsets(self.state.named["latent_tokens"], self.state.world)[self.state.rank]
        local = min(max(whole - start, 0), args[0].shape[1])
        if "num_tokens" in kwargs:
            return args, dict(kwargs, num_tokens=local)
        return (*args[:self.POSITION], local, *args[self.POSITION + 1:]), kwargs


def _sequence_plan(model: torch.nn.Module) -> SequenceParallelSpec:
    cpi, cpo = private.cp_types()
    token_replace = model.config.get("image_condition_type") == "token_replace"
    root, block = (_TokenReplaceRoot, _TokenReplaceBlock) if token_replace else (_MaskRoot, _BlockMask)
    return SequenceParallelSpec(
        cp_plan={
            "x_embedder": {0: cpi(split_dim=1, expected_dims=3, split_output=True)},
            "context_embedder": {0: cpi(split_dim=1, expected_dims=3, split_output=True)},
            "rope": {
                0: cpi(split_dim=0, expected_dims=2, split_output=True),
                1: cpi(split_dim=0, expected_dims=2, split_output=True),
            },
            "proj_out": cpo(gather_dim=1, expected_dims=3),
        },
        # the token refiner attends the whole text inside context_embedder, before the split
        local_attention=("context_embedder.*",),
        extra_hooks=[
            ("transformer_blocks.*", block),
            ("single_transformer_blocks.*", block),
            ("", root),
        ],
    )


SPECS = (
    ModelSpec(
        name="tiny-hunyuanvideo", family="hunyuanvideo", size="tiny", kind="video",
        pipeline_class="HunyuanVideoPipeline", patch_multiple=16, height=32, width=32, frames=5, frame_multiple=4,
        steps=2, guidance=6.0, max_sequence_length=16, fps=24,
        call_kwargs={"prompt_template": PROMPT_TEMPLATE},  # its crop_start counts the in-code tokenizer
        description="HunyuanVideo architecture, 1+1 blocks, 4 heads x 16, Llama + CLIP text encoders, random weights",
    ),
    ModelSpec(
        name="full-hunyuanvideo", family="hunyuanvideo", size="full", kind="video",
        pipeline_class="HunyuanVideoPipeline", patch_multiple=16, height=720, width=1280, frames=129, frame_multiple=4,
        steps=50, guidance=6.0, max_sequence_length=256, fps=24,
        description="HunyuanVideo dimensions (13B transformer: 20 + 40 blocks, 24 heads x 128), random weights",
    ),
)

SPECS += (
    ModelSpec(
        name="tiny-hunyuanvideo-i2v", family="hunyuanvideo", size="tiny", kind="video",
        pipeline_class="HunyuanVideoImageToVideoPipeline", variant="i2v", patch_multiple=16, height=32, width=32,
        frames=5, frame_multiple=4, steps=2, guidance=6.0, max_sequence_length=24, fps=24,
        call_kwargs={"prompt_template": I2V_PROMPT_TEMPLATE},  # its counts are the in-code tokenizer's
        description="HunyuanVideo-I2V architecture (LLaVA text encoder, first-frame tokens modulated apart), 1+1 "
                    "blocks, 4 heads x 16, random weights",
    ),
)

RECORD = FamilyRecord(
    name="hunyuanvideo", title="HunyuanVideo", kind="video",
    pipelines={"HunyuanVideoPipeline": "t2v", "HunyuanVideoImageToVideoPipeline": "i2v"},
    # the first frame, resized to the video's size; one prompt a call: the negative branch of true CFG encodes one
    # black image for all prompts (LLaVA then counts fewer images than prompts), and a prompt cut at
    # max_sequence_length is handled for a batch of one only
    image_inputs={"HunyuanVideoImageToVideoPipeline": ImageInputFacts(batch="alone", size_from_image=False)},
    transformers=("HunyuanVideoTransformer3DModel",),
    sp=SequenceParallelFacts(plan_source="xstage", build=_sequence_plan),
    limits=SizeLimits(patch_multiple=16, frame_multiple=4), specs=SPECS,
    build=build, build_transformer=build_transformer, transformer_dims=TRANSFORMER,
    real_weights_example="HunyuanVideo", pipeline_worlds=(2, 4),
)
