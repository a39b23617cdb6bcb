"""HunyuanVideo 1.5 text-to-video (`HunyuanVideo15Pipeline`): tiny (2 double-stream blocks, 4 heads x 16, a
3-layer Qwen2.5-VL language model (the pipeline reads the hidden state 3rd from the end) over the in-code Qwen
tokenizer and its chat template, a ByT5 glyph encoder (a 1-layer `T5EncoderModel` over transformers' own
byte-level `ByT5Tokenizer`, which needs no files), the HunyuanVideo 1.5 VAE with 3 levels (4x spatial, 4x
temporal), classifier-free guidance through the pipeline's guider; random weights, CPU seconds) and full
(HunyuanVideo-1.5-480p_t2v dimensions, diffusers' class defaults with task "t2v": the 8.3B transformer, 54
blocks, 16 heads x 128; Qwen2.5-VL-7B's language model, the ByT5-small glyph encoder; the HunyuanVideo 1.5 VAE).

What the pipeline passes the transformer, every call: the latents with the (zero, for T2V) condition latents
and mask as channels, the LLM prompt padded to ``tokenizer_max_length`` with its mask, the ByT5 embedding of
the prompt's quoted text (glyphs; zeros and an all-zero mask when it quotes none) padded to
``tokenizer_2_max_length``, and ``vision_num_semantic_tokens`` zero image embeddings (masked out for T2V).
The transformer reorders them into [valid image, valid ByT5, valid LLM, padding] with one (batch, text) mask.
CFG is the guider's: two calls per step (cond, then the negative prompt).

The real pipeline hard-codes 1000 LLM / 256 ByT5 / 729 image tokens and crops the chat template's first 108
tokens (counted under the real tokenizer) as instance attributes; `build` sets them on the instance for the
tiny model (`SEQUENCE`) and counts the crop under the in-code tokenizer (both sizes: the tokenizer is in code).

The record: our plan (the [video, reordered text] joint sequence split at the first block; the token refiner
attends the whole prompt before it), no CFG parallel (the guider's two calls).

Image-to-video (`HunyuanVideo15ImageToVideoPipeline`, HunyuanVideo-1.5-480p_i2v): the image's latents fill the
condition channels of the first latent frame (the mask marks it), so they shard with the video tokens; its SigLIP
tokens (729, ``image_embed_dim`` 1152) become the valid image part of the reordered text, split with it by the
same plan. The pipeline takes no height or width: it makes the size bucket of ``target_size`` (16-pixel patches of
the 16x VAE) nearest the image's aspect ratio (`_bucket_size`, diffusers' own rule), so a request's size is that.
"""

from __future__ import annotations

import torch

from xstage_dit import _diffusers_private as private
from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.nucleusmoe import CHAT_TEMPLATE
from xstage_dit.families.qwenimage import TEXT as QWEN25VL_TEXT
from xstage_dit.families.qwenimage import qwen25vl_text_encoder
from xstage_dit.families.record import FamilyRecord, ImageInputFacts, SequenceParallelFacts, SizeLimits
from xstage_dit.families.sp_plan import SequenceParallelSpec, blocks_of, rope_split
from xstage_dit.families.spec import ModelSpec
from xstage_dit.families.tokenizers import template_prefix_tokens

# the pipeline reads hidden_states[-3]: 3 layers (tiny)
TEXT = {"full": QWEN25VL_TEXT["full"], "tiny": dict(QWEN25VL_TEXT["tiny"], num_hidden_layers=3)}

# ByT5 (a T5 encoder over bytes): transformers' ByT5Tokenizer has 3 specials + 256 bytes + 125 extra ids = 384
BYT5 = {
    # ByT5-small (the glyph encoder)
    "full": dict(vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6, feed_forward_proj="gated-gelu",
                 is_encoder_decoder=False, use_cache=False),
    "tiny": dict(vocab_size=384, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                     feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False)}

# in_channels: latents + condition latents + mask (2 * latent_channels + 1), as the pipeline concatenates them
TRANSFORMER = {
    "full": dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128, num_layers=54,
                 num_refiner_layers=2, text_embed_dim=TEXT["full"]["hidden_size"], text_embed_2_dim=BYT5["full"]["d_model"],
                 image_embed_dim=1152, rope_axes_dim=(16, 56, 56), target_size=640, task_type="t2v"),
    "tiny": dict(in_channels=9, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=2,
                 num_refiner_layers=1, text_embed_dim=TEXT["tiny"]["hidden_size"], text_embed_2_dim=BYT5["tiny"]["d_model"],
                 image_embed_dim=16, rope_axes_dim=(4, 6, 6), target_size=64, task_type="t2v"),
}

# image-to-video: the same channels (the condition latents now hold the image's), the SigLIP tokens' width; the
# tiny target size 64 makes buckets of at most 4x4 latent patches (64x64, 64x48, 80x48, ...)
TRANSFORMER["tiny-i2v"] = dict(TRANSFORMER["tiny"], task_type="i2v")

# 3 levels, the first two downsampling 2x in space and time: 4x spatial, 4x temporal
VAE = {"full": dict(),  # the class defaults: HunyuanVideo 1.5's VAE (32 latent channels, 16x spatial, 4x temporal)
       "tiny": dict(latent_channels=4, block_out_channels=(8, 8, 8), layers_per_block=1, spatial_compression_ratio=4,
                    temporal_compression_ratio=4)}
#: the image-to-video pipeline's size buckets are in 16-pixel patches, the published VAE's factor: the tiny I2V
#: model's VAE has it too (5 levels)
I2V_VAE_FACTOR = 16
VAE["tiny-i2v"] = dict(VAE["tiny"], block_out_channels=(8,) * 5, spatial_compression_ratio=I2V_VAE_FACTOR)

# the image encoder (HunyuanVideo-1.5 I2V: SigLIP so400m-patch14-384, 729 tokens of 1152); tiny: 24 / 8 = 3x3 tokens
SIGLIP = {"tiny": dict(hidden_size=TRANSFORMER["tiny"]["image_embed_dim"], intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, image_size=24, patch_size=8)}

# the pipeline's token counts (instance attributes it reads), for the tiny model: 24 LLM + 16 ByT5 + 9 image
SEQUENCE = {"tiny": dict(tokenizer_max_length=24, tokenizer_2_max_length=16, vision_num_semantic_tokens=9)}

GUIDANCE_SCALE = 6.0


def prompt_template(tokenizer, system_message: str) -> str:
    """The text the pipeline's chat template makes of a prompt, with ``{}`` where the prompt goes."""
    messages = [{"role": "system", "content": system_message}, {"role": "user", "content": "{}"}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


VARIANTS = ("", "i2v")  # text-to-video, image-to-video


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0, variant: str = ""):
    from diffusers import HunyuanVideo15Transformer3DModel

    config = TRANSFORMER[f"{size}-{variant}" if variant else size]
    return build_module(lambda: HunyuanVideo15Transformer3DModel(**config), seed=seed, device=device, dtype=dtype)


def _image_encoder(size: str, *, dtype: torch.dtype, device, seed: int) -> dict:
    """The I2V pipeline's SigLIP vision tower and its processor (resized to the tower's side), random weights."""
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    config = SIGLIP[size]
    side = config["image_size"]
    return dict(image_encoder=build_module(lambda: SiglipVisionModel(SiglipVisionConfig(**config)), seed=seed,
                                           device=device, dtype=dtype),
                feature_extractor=SiglipImageProcessor(size={"height": side, "width": side}))


def build(size: str, *, dtype: torch.dtype, device, seed: int, variant: str = ""):
    import diffusers
    from diffusers import AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    if variant not in VARIANTS:
        raise ValueError(f"expected a HunyuanVideo 1.5 variant in {VARIANTS}, got {variant!r}")
    tokenizer, text_encoder = qwen25vl_text_encoder(TEXT[size], None, seed=seed + 1, device=device, dtype=dtype)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer_2 = ByT5Tokenizer()
    check_vocab(tokenizer_2, BYT5[size]["vocab_size"], "ByT5")
    key = f"{size}-{variant}" if variant else size
    extra = _image_encoder(size, dtype=dtype, device=device, seed=seed + 4) if variant else {}
    pipeline = diffusers.HunyuanVideo15ImageToVideoPipeline if variant else diffusers.HunyuanVideo15Pipeline
    pipe = pipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed, variant=variant),
        vae=build_module(lambda: AutoencoderKLHunyuanVideo15(**VAE[key]), seed=seed + 2, device=device, dtype=dtype),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=build_module(lambda: T5EncoderModel(T5Config(**BYT5[size])), seed=seed + 3, device=device,
                                    dtype=dtype),
        tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=GUIDANCE_SCALE),
        **extra,
    )
    for name, value in SEQUENCE.get(size, {}).items():  # full: the pipeline's own token counts
        setattr(pipe, name, value)
    pipe.prompt_template_encode_start_idx = template_prefix_tokens(tokenizer, prompt_template(tokenizer, pipe.system_message))
    return pipe


# ---- the record ---------------------------------------------------------------------------------------------

def _sequence_plan(model: torch.nn.Module) -> SequenceParallelSpec:
    """[video, reordered text] blocks; the processor masks valid_q & valid_k."""
    cpi, cpo = private.cp_types()
    blocks_of(model, "transformer_blocks")
    rope = rope_split(cpi, 0, 2)
    return SequenceParallelSpec(
        cp_plan={
            "rope": rope,  # (cos, sin), (S_video, d)
            "transformer_blocks.0": {
                "hidden_states": cpi(split_dim=1, expected_dims=3),
                "encoder_hidden_states": cpi(split_dim=1, expected_dims=3),
            },
            # the forward hands every block the (batch, text) mask of its reordered [image, ByT5, LLM] text;
            # the processor pads it with the (local) video tokens and masks valid_q & valid_k
            "transformer_blocks.*": {"attention_mask": cpi(split_dim=1, expected_dims=2)},
            "proj_out": cpo(gather_dim=1, expected_dims=3),
        },
        local_attention=("context_embedder.*",),  # the token refiner, on the whole prompt before the split
    )


SPECS = (
    ModelSpec(
        name="tiny-hunyuanvideo15", family="hunyuanvideo15", size="tiny", kind="video",
        pipeline_class="HunyuanVideo15Pipeline", patch_multiple=4, height=32, width=32, frames=5, frame_multiple=4,
        steps=2, guidance=1.0, fps=24,  # CFG is its guider's (scale 6), not a call argument
        description="HunyuanVideo 1.5 architecture, 2 blocks, 4 heads x 16, Qwen2.5-VL + ByT5 text encoders, "
        "random weights",
    ),
    ModelSpec(
        name="full-hunyuanvideo15", family="hunyuanvideo15", size="full", kind="video",
        pipeline_class="HunyuanVideo15Pipeline", patch_multiple=16, height=480, width=848, frames=121, frame_multiple=4,
        steps=50, guidance=1.0, fps=24,  # CFG is its guider's, not a call argument
        description="HunyuanVideo-1.5 480p T2V dimensions (8.3B transformer: 54 blocks, 16 heads x 128), random weights",
    ),
)

SPECS += (
    ModelSpec(
        name="tiny-hunyuanvideo15-i2v", family="hunyuanvideo15", size="tiny", kind="video",
        pipeline_class="HunyuanVideo15ImageToVideoPipeline", variant="i2v", patch_multiple=16, height=48, width=64,
        frames=5, frame_multiple=4, steps=2, guidance=1.0, fps=24,  # the size is the image's bucket (64x48: 4:3)
        description="HunyuanVideo 1.5 I2V architecture (SigLIP image tokens, image latents on channels), 2 blocks, "
                    "4 heads x 16, random weights",
    ),
)


def _bucket_size(config, width: int, height: int) -> tuple[int, int]:
    """(width, height) HunyuanVideo 1.5 I2V makes from an image of width x height: its processor's bucket of the
    transformer's ``target_size`` nearest the image's aspect ratio (diffusers' own rule, in 16-pixel patches)."""
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    processor = HunyuanVideo15ImageProcessor(vae_scale_factor=I2V_VAE_FACTOR)
    made_height, made_width = processor.calculate_default_height_width(height=height, width=width,
                                                                       target_size=config["target_size"])
    return int(made_width), int(made_height)


RECORD = FamilyRecord(
    name="hunyuanvideo15", title="HunyuanVideo 1.5", kind="video",
    pipelines={"HunyuanVideo15Pipeline": "t2v", "HunyuanVideo15ImageToVideoPipeline": "i2v"},
    # one image shared by every prompt (its latents and tokens repeated); the video's size is the image's bucket
    image_inputs={"HunyuanVideo15ImageToVideoPipeline": ImageInputFacts(size_from_image=False,
                                                                        output_size=_bucket_size)},
    transformers=("HunyuanVideo15Transformer3DModel",),
    sp=SequenceParallelFacts(plan_source="xstage", build=_sequence_plan, cfg=None),
    limits=SizeLimits(patch_multiple=16, frame_multiple=4), specs=SPECS,
    build=build, build_transformer=build_transformer, transformer_dims=TRANSFORMER,
    real_weights_example="HunyuanVideo-1.5-480p_t2v", pipeline_worlds=(2, 4),
)
