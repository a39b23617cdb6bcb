"""SkyReels-V2 (`SkyReelsV2DiffusionForcingPipeline`: diffusion forcing, per-frame noise levels and a
block-causal mask): tiny (2 blocks, 4 heads, the tiny Wan VAE and UMT5; random weights, CPU seconds) and full
(SkyReels-V2-DF-14B-540P dimensions: the Wan2.1-T2V-14B transformer it is trained from, 40 blocks, 40 heads x
128; UMT5-XXL; the Wan VAE).

The record: our plan (Wan-like; diffusion forcing adds per-token modulation and a block-causal mask, whose
query rows follow the token split), no CFG parallel.

Image-to-video (`SkyReelsV2ImageToVideoPipeline`, SkyReels-V2-I2V): Wan 2.1 I2V's scheme on this transformer (the
first frame's latents and a mask on channels, sharded with the latents; CLIP image tokens beside the text in each
block's cross-attention, whole on every rank), plain per-step timesteps; its optional ``last_image`` is Wan's
first-last-frame, taken by a transformer with the two-image position embedding only (`wan.frame_counts`).
"""

from __future__ import annotations

import torch

from xstage_dit import _diffusers_private as private
from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.record import (FamilyRecord, FeatureFacts, ImageInputFacts, SequenceParallelFacts,
                                       SizeLimits)
from xstage_dit.families.sp_plan import SequenceParallelSpec, blocks_of, rope_split
from xstage_dit.families.spec import ModelSpec
from xstage_dit.families.tokenizers import t5_tokenizer
from xstage_dit.families.wan import TRANSFORMER as WAN, UMT5, VAE, WAN_VAE, frame_counts

# 4 heads (the tiny Wan has 2) so that sp=4 can split them
TRANSFORMER = {"full": dict(WAN["full"], num_frame_per_block=1),
               "tiny": dict(WAN["tiny"], num_attention_heads=4, num_frame_per_block=1)}
# image-to-video: the noise, the first-frame mask (4) and its latents on channels; CLIP image tokens (image_dim) read
# by key/value projections as wide as the blocks (4 heads x 16)
TRANSFORMER["tiny-i2v"] = dict(TRANSFORMER["tiny"], in_channels=4 + 4 + 4, image_dim=16, added_kv_proj_dim=64)

#: variant -> its pipeline class ("": diffusion forcing text-to-video)
PIPELINES = {"": "SkyReelsV2DiffusionForcingPipeline", "i2v": "SkyReelsV2ImageToVideoPipeline"}


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0, variant: str = ""):
    from diffusers import SkyReelsV2Transformer3DModel

    config = TRANSFORMER[f"{size}-{variant}" if variant else size]
    return build_module(lambda: SkyReelsV2Transformer3DModel(**config), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int, variant: str = ""):
    import diffusers
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    from xstage_dit.families.wan import SCHEDULER, clip_image_encoder

    if variant not in PIPELINES:
        raise ValueError(f"expected a SkyReels-V2 variant in {sorted(PIPELINES)}, got {variant!r}")
    tokenizer = t5_tokenizer(512)
    check_vocab(tokenizer, UMT5[size]["vocab_size"], "UMT5")
    extra = {}
    if variant == "i2v":
        encoder, processor = clip_image_encoder(size, dtype=dtype, device=device, seed=seed + 3)
        extra = dict(image_encoder=encoder, image_processor=processor)
    return getattr(diffusers, PIPELINES[variant])(
        tokenizer=tokenizer,
        text_encoder=build_module(lambda: UMT5EncoderModel(UMT5Config(**UMT5[size])), seed=seed + 1, device=device,
                                  dtype=dtype),
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed, variant=variant),
        vae=build_module(lambda: AutoencoderKLWan(**VAE[size]), seed=seed + 2, device=device, dtype=torch.float32),
        scheduler=UniPCMultistepScheduler(**SCHEDULER),
        **extra,
    )


# ---- the record ---------------------------------------------------------------------------------------------

def _sequence_plan(model: torch.nn.Module) -> SequenceParallelSpec:
    cpi, cpo = private.cp_types()
    last = blocks_of(model, "blocks") - 1
    rope = rope_split(cpi, 1, 4)
    return SequenceParallelSpec(
        cp_plan={
            "rope": rope,
            "blocks.0": {"hidden_states": cpi(split_dim=1, expected_dims=3)},
            # diffusion forcing: temb (batch, 6, seq, dim) per token and a (1, 1, seq_q, seq_k) block-causal mask,
            # whose query rows follow the tokens (its key columns stay whole: the backend gathers the keys)
            "blocks.*": {
                "temb": cpi(split_dim=2, expected_dims=4),
                "attention_mask": cpi(split_dim=2, expected_dims=4),
            },
            # norm_out then adds a full-length per-token shift in diffusion forcing: gather before it
            f"blocks.{last}": cpo(gather_dim=1, expected_dims=3),
        },
        kv_layouts={"blocks.*.attn2": "replicated"},
    )


SPECS = (
    ModelSpec(
        name="tiny-skyreels-v2", family="skyreels-v2", size="tiny", kind="video",
        pipeline_class="SkyReelsV2DiffusionForcingPipeline", patch_multiple=16, height=64, width=64, frames=5,
        frame_multiple=4, steps=2, guidance=1.0, max_sequence_length=16, fps=24,
        description="SkyReels-V2 diffusion forcing, 2 blocks, 4 heads x 16, random weights",
    ),
    ModelSpec(
        name="full-skyreels-v2", family="skyreels-v2", size="full", kind="video",
        pipeline_class="SkyReelsV2DiffusionForcingPipeline", patch_multiple=16, height=544, width=960, frames=97,
        frame_multiple=4, steps=50, guidance=6.0, max_sequence_length=512, fps=24,
        description="SkyReels-V2-DF-14B-540P dimensions (40 blocks, 40 heads x 128), random weights",
    ),
)

SPECS += (
    ModelSpec(
        name="tiny-skyreels-v2-i2v", family="skyreels-v2", size="tiny", kind="video",
        pipeline_class="SkyReelsV2ImageToVideoPipeline", variant="i2v", patch_multiple=16, height=64, width=64,
        frames=5, frame_multiple=4, steps=2, guidance=5.0, max_sequence_length=16, fps=24,
        description="SkyReels-V2 I2V architecture (Wan 2.1 I2V's first frame and CLIP tokens), 2 blocks, 4 heads x "
                    "16, random weights",
    ),
)

RECORD = FamilyRecord(
    name="skyreels-v2", title="SkyReels-V2", kind="video",
    pipelines={"SkyReelsV2DiffusionForcingPipeline": "t2v", "SkyReelsV2ImageToVideoPipeline": "i2v"},
    # as Wan's: the first frame (and a first-last-frame checkpoint's last), resized to the video's size, shared
    image_inputs={"SkyReelsV2ImageToVideoPipeline": ImageInputFacts(max_images=2, extra_arguments=("last_image",),
                                                                    checkpoint_counts=frame_counts,
                                                                    size_from_image=False)},
    transformers=("SkyReelsV2Transformer3DModel",),
    sp=SequenceParallelFacts(plan_source="xstage", build=_sequence_plan, cfg=None),
    limits=SizeLimits(patch_multiple=16, frame_multiple=4), facts=FeatureFacts(video_vae=WAN_VAE), specs=SPECS,
    build=build, build_transformer=build_transformer, transformer_dims=TRANSFORMER,
    real_weights_example="SkyReels-V2-DF-14B-540P-Diffusers", pipeline_worlds=(2, 4),
)
