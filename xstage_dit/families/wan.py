"""Wan 2.1 text-to-video (`WanPipeline`) and image-to-video (`WanImageToVideoPipeline`): tiny (CPU seconds) and
full (Wan2.1-T2V-14B and Wan2.1-I2V-14B-480P dimensions) built-ins, and a tiny Wan 2.2 A14B image-to-video and a
tiny Wan 2.1 first-last-frame-to-video (FLF2V).

Full size: transformer 40 blocks, 40 heads x 128 (5120 wide), FFN 13824, patch (1, 2, 2), text dim 4096
(UMT5-XXL); Wan VAE (8x spatial, 4x temporal, 16 latent channels); UniPC flow scheduler, shift 3 (480p).
Image-to-video: the transformer takes 36 channels (the noise, a 4-channel first-frame mask and the first frame's
latents), and Wan 2.1's also 257 CLIP ViT-H/14 image tokens (``image_dim`` 1280) that each block's cross-attention
reads with its own key/value projections; Wan 2.2's has no image encoder and two experts (``transformer_2`` below
``boundary_ratio``). First-last-frame (Wan2.1-FLF2V-14B-720P, the same pipeline's ``last_image``): the last frame's
latents are on the same channels (at the last latent frame, the mask marks it), and both images' CLIP tokens (2 x 257,
with a position embedding over them) go to the cross-attention: that checkpoint needs both frames, the others take
the first only (`frame_counts`, read from the transformer config).

The record: diffusers' own sequence plan (cross-attention keys, the text and the image tokens, are whole on every
rank; the mask and first-frame channels are concatenated per token, so they shard with the latents), paired CFG
(on when guidance_scale > 1); Wan 2.2 A14B's second expert (``transformer_2``) is the same class. `WAN_VAE`: the
Wan VAE's facts, shared by the families whose pipelines use it (SkyReels-V2, Wan-VACE, Helios, ChronoEdit).
"""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module, check_vocab, clip_image_processor
from xstage_dit.families.record import (FamilyRecord, FeatureFacts, ImageInputFacts, SequenceParallelFacts,
                                       SizeLimits, VideoVAEFacts)
from xstage_dit.families.sp_plan import shipped_plan
from xstage_dit.families.spec import ModelSpec
from xstage_dit.families.tokenizers import t5_tokenizer

TRANSFORMER = {
    "full": dict(
        patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
        text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
    ),
    "tiny": dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64,
    ),
}
# image-to-video: noise + first-frame mask (4) + first-frame latents; Wan 2.1's CLIP image tokens (image_dim)
TRANSFORMER["full-i2v"] = dict(TRANSFORMER["full"], in_channels=16 + 4 + 16, image_dim=1280, added_kv_proj_dim=5120)
TRANSFORMER["tiny-i2v"] = dict(TRANSFORMER["tiny"], in_channels=4 + 4 + 4, image_dim=16, added_kv_proj_dim=32)
TRANSFORMER["tiny-i2v22"] = dict(TRANSFORMER["tiny"], in_channels=4 + 4 + 4)
# first-last-frame (Wan2.1-FLF2V-14B-720P): the I2V transformer, whose image embedder adds a position embedding over
# both images' CLIP tokens (2 x 257 there; the tiny tower's 2 x 17: 16 patches and the class token)
TRANSFORMER["tiny-flf2v"] = dict(TRANSFORMER["tiny-i2v"], pos_embed_seq_len=2 * 17)

# Wan 2.1 I2V's image encoder: CLIP ViT-H/14 (its hidden states -2 are read), and its processor's crop
CLIP_VISION = {
    "full": dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                 image_size=224, patch_size=14, projection_dim=1024, hidden_act="gelu"),
    "tiny": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                 patch_size=8, projection_dim=16, hidden_act="gelu"),
}
#: Wan 2.2 A14B's switch from the high-noise expert to transformer_2 (its model_index.json)
BOUNDARY_RATIO = 0.9

_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                 0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]

VAE = {
    "full": dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                 temperal_downsample=[False, True, True], latents_mean=_LATENTS_MEAN, latents_std=_LATENTS_STD),
    # Same depth (8x spatial, 4x temporal), a few channels.
    "tiny": dict(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
                 temperal_downsample=[False, True, True], latents_mean=_LATENTS_MEAN[:4],
                 latents_std=_LATENTS_STD[:4]),
}

UMT5 = {
    "full": dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                 feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
                 relative_attention_num_buckets=32, pad_token_id=0, eos_token_id=1),
    "tiny": dict(vocab_size=1024, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                 feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
                 relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1),
}

SCHEDULER = dict(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0)


# text-to-video, Wan 2.1 image-to-video, Wan 2.2 A14B image-to-video, Wan 2.1 first-last-frame-to-video
VARIANTS = ("", "i2v", "i2v22", "flf2v")


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0, variant: str = ""):
    """The `WanTransformer3DModel` alone (an image-to-video variant's has its own channels)."""
    from diffusers import WanTransformer3DModel

    config = TRANSFORMER[f"{size}-{variant}" if variant else size]
    return build_module(lambda: WanTransformer3DModel(**config), seed=seed, device=device, dtype=dtype)


def clip_image_encoder(size: str, *, dtype: torch.dtype, device, seed: int):
    """(CLIP vision tower, its image processor) of Wan 2.1 I2V (and SkyReels-V2 I2V), random weights."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    config = CLIP_VISION[size]
    return build_module(lambda: CLIPVisionModel(CLIPVisionConfig(**config)), seed=seed, device=device,
                        dtype=dtype), clip_image_processor(config["image_size"])


def build(size: str, *, dtype: torch.dtype, device, seed: int, variant: str = ""):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    if variant not in VARIANTS:
        raise ValueError(f"expected a Wan variant in {VARIANTS}, got {variant!r}")
    tokenizer = t5_tokenizer(512)
    check_vocab(tokenizer, UMT5[size]["vocab_size"], "UMT5")
    # The Wan VAE stays in float32 as in the published pipeline (its causal 3D convs lose detail in bf16).
    vae = build_module(lambda: AutoencoderKLWan(**VAE[size]), seed=seed + 2, device=device, dtype=torch.float32)
    parts = dict(
        tokenizer=tokenizer,
        text_encoder=build_module(lambda: UMT5EncoderModel(UMT5Config(**UMT5[size])), seed=seed + 1, device=device,
                                  dtype=dtype),
        vae=vae,
        scheduler=UniPCMultistepScheduler(**SCHEDULER),
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed, variant=variant),
    )
    if variant == "":
        return WanPipeline(**parts)
    if variant in ("i2v", "flf2v"):
        encoder, processor = clip_image_encoder(size, dtype=dtype, device=device, seed=seed + 3)
        return WanImageToVideoPipeline(**parts, image_encoder=encoder, image_processor=processor)
    # Wan 2.2 A14B: no image encoder; the low-noise expert below the boundary
    expert = build_transformer(size, dtype=dtype, device=device, seed=seed + 4, variant=variant)
    return WanImageToVideoPipeline(**parts, transformer_2=expert, boundary_ratio=BOUNDARY_RATIO)


# ---- the record ---------------------------------------------------------------------------------------------

#: the Wan VAE: causal 3-D convolutions, one latent frame (1, then 4 video frames) a decoder call, in order
WAN_VAE = VideoVAEFacts(vae_class="AutoencoderKLWan", causal_conv_class="WanCausalConv3d", streams_frames=True)
#: the cross-attention's keys are the text, whole on every rank under diffusers' plan
CROSS_ATTENTION_KV = {"blocks.*.attn2": "replicated"}

SPECS = (
    ModelSpec(
        name="tiny-wan", family="wan", size="tiny", kind="video", pipeline_class="WanPipeline",
        patch_multiple=16, height=128, width=128, frames=9, frame_multiple=4, steps=4, guidance=5.0,
        max_sequence_length=32, fps=16,
        description="Wan 2.1 T2V architecture, 2 blocks, 2 heads x 16, random weights (CPU seconds)",
    ),
    ModelSpec(
        name="full-wan", family="wan", size="full", kind="video", pipeline_class="WanPipeline",
        patch_multiple=16, height=480, width=832, frames=81, frame_multiple=4, steps=50, guidance=5.0,
        max_sequence_length=512, fps=16,
        description="Wan2.1-T2V-14B dimensions (40 blocks, 40 heads x 128), 480p x 81 frames, random weights",
    ),
)

SPECS += (
    ModelSpec(
        name="tiny-wan-i2v", family="wan", size="tiny", kind="video", pipeline_class="WanImageToVideoPipeline",
        variant="i2v", patch_multiple=16, height=128, width=128, frames=9, frame_multiple=4, steps=4, guidance=5.0,
        max_sequence_length=32, fps=16,
        description="Wan 2.1 I2V architecture (CLIP image tokens), 2 blocks, 2 heads x 16, random weights",
    ),
    ModelSpec(
        name="full-wan-i2v", family="wan", size="full", kind="video", pipeline_class="WanImageToVideoPipeline",
        variant="i2v", patch_multiple=16, height=480, width=832, frames=81, frame_multiple=4, steps=50, guidance=5.0,
        max_sequence_length=512, fps=16,
        description="Wan2.1-I2V-14B-480P dimensions (40 blocks, 40 heads x 128, CLIP ViT-H/14), 480p x 81 frames, "
                    "random weights",
    ),
    ModelSpec(
        name="tiny-wan22-i2v", family="wan", size="tiny", kind="video", pipeline_class="WanImageToVideoPipeline",
        variant="i2v22", patch_multiple=16, height=128, width=128, frames=9, frame_multiple=4, steps=4, guidance=5.0,
        max_sequence_length=32, fps=16,
        description="Wan 2.2 A14B I2V architecture (two experts, no image encoder), 2 blocks, 2 heads x 16, random "
                    "weights",
    ),
)

SPECS += (
    ModelSpec(
        name="tiny-wan-flf2v", family="wan", size="tiny", kind="video", pipeline_class="WanImageToVideoPipeline",
        variant="flf2v", patch_multiple=16, height=128, width=128, frames=9, frame_multiple=4, steps=4,
        guidance=5.0, max_sequence_length=32, fps=16,
        description="Wan 2.1 FLF2V architecture (first and last frame, CLIP tokens of both), 2 blocks, 2 heads x 16, "
                    "random weights",
    ),
)


def frame_counts(config) -> tuple[int, int]:
    """(min, max) input images of a Wan image-to-video checkpoint: the FLF2V transformer (a position embedding over
    two images' CLIP tokens) needs the first and the last frame; the others take the first only (Wan 2.1 I2V's
    embedder reads one image's tokens, Wan 2.2 A14B was made for the first frame)."""
    return (2, 2) if config.get("pos_embed_seq_len") else (1, 1)


RECORD = FamilyRecord(
    name="wan", title="Wan 2.1 / 2.2", kind="video",
    pipelines={"WanPipeline": "t2v", "WanImageToVideoPipeline": "i2v"},
    # the first frame (and FLF2V's last, ``last_image``): the video's size is the model's (the images are resized
    # to it); shared by every prompt
    image_inputs={"WanImageToVideoPipeline": ImageInputFacts(max_images=2, extra_arguments=("last_image",),
                                                             checkpoint_counts=frame_counts,
                                                             size_from_image=False)},
    transformers=("WanTransformer3DModel",),
    sp=SequenceParallelFacts(plan_source="diffusers", build=shipped_plan(CROSS_ATTENTION_KV), cfg_needs_guidance=True),
    limits=SizeLimits(patch_multiple=16, frame_multiple=4), facts=FeatureFacts(video_vae=WAN_VAE), specs=SPECS,
    build=build, build_transformer=build_transformer, transformer_dims=TRANSFORMER,
    real_weights_example="Wan2.1-T2V-14B-Diffusers", pipeline_worlds=(2, 4),
)
