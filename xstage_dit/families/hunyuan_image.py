"""HunyuanImage 2.1 text-to-image (`HunyuanImagePipeline`): tiny (1 double + 1 single block, 4 heads x 16, a
Qwen2.5-VL text encoder (3 layers: the pipeline reads the hidden state 3rd from the end; a 1-layer vision
tower, as the real class has one) over the in-code Qwen tokenizer, a ByT5 glyph encoder (the tiny T5 encoder of
HunyuanVideo 1.5 over transformers' file-less `ByT5Tokenizer`), the HunyuanImage VAE with 3 levels (4x
spatial); random weights, CPU seconds) and full (HunyuanImage-2.1 dimensions, diffusers' class defaults with
the ByT5 glyph input: the 17B transformer, 20 double + 40 single blocks, 28 heads x 128; Qwen2.5-VL-7B and
ByT5-small; its 32x VAE with 64 latent channels). The refiner pipeline is not built.

What the pipeline passes the transformer: the LLM prompt padded to ``tokenizer_max_length`` (its template's
system prefix cropped) with its mask, the ByT5 embedding of the prompt's quoted text (zeros and an all-zero mask
when it quotes none) padded to ``tokenizer_2_max_length``; the transformer reorders them into [valid ByT5, valid
LLM, padding] and masks [image, text] keys with one (batch, 1, 1, keys) mask. Two variants, as published:

- the base model (``distilled=False``): adaptive projected guidance (`AdaptiveProjectedMixGuidance`), two calls
  per step, with a separate ``ocr_guider`` taken when the prompt quotes text;
- the distilled model (``distilled=True``): guidance and the MeanFlow ``timestep_r`` embedded, no guider, one
  call per step.

The real pipeline's 1000 LLM / 128 ByT5 tokens and its crop of 34 template tokens (the real tokenizer's count)
are instance attributes; `build` sets them for the tiny model (`SEQUENCE`) and counts the crop in code.

The record: our plan (dual + single blocks on [image, text], split at the first dual block; the key mask is
rebuilt from the shards), no CFG parallel.
"""

from __future__ import annotations

import torch

from xstage_dit import _diffusers_private as private
from xstage_dit.families import latent_decode, sharding
from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.hunyuan_video15 import BYT5
from xstage_dit.families.hunyuan_video15 import TEXT as QWEN25VL_TEXT  # tiny: 3 layers (it reads hidden_states[-3])
from xstage_dit.families.qwenimage import VISION as QWEN25VL_VISION
from xstage_dit.families.qwenimage import qwen25vl_text_encoder
from xstage_dit.families.record import FamilyRecord, SequenceParallelFacts, SizeLimits
from xstage_dit.families.sp_plan import PlanHook, SequenceParallelSpec, blocks_of, rope_split
from xstage_dit.families.spec import ModelSpec
from xstage_dit.families.tokenizers import template_prefix_tokens

TRANSFORMER = {
    "full": dict(in_channels=64, out_channels=64, num_attention_heads=28, attention_head_dim=128, num_layers=20,
                 num_single_layers=40, num_refiner_layers=2, text_embed_dim=QWEN25VL_TEXT["full"]["hidden_size"],
                 text_embed_2_dim=BYT5["full"]["d_model"], rope_axes_dim=(64, 64)),
    "tiny": dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=1,
                 num_single_layers=1, num_refiner_layers=1, text_embed_dim=QWEN25VL_TEXT["tiny"]["hidden_size"],
                 text_embed_2_dim=BYT5["tiny"]["d_model"], rope_axes_dim=(8, 8)),
}
DISTILLED = dict(guidance_embeds=True, use_meanflow=True)  # HunyuanImage-2.1-Distilled

# 3 levels, two 2x downsamples; 32 channels: its GroupNorms have 32 groups. The class has no default
# scaling_factor (None), which the pipeline divides by: the published VAE's
VAE = {"full": dict(in_channels=3, out_channels=3, latent_channels=64, block_out_channels=(128, 256, 512, 512, 1024, 1024),
                    layers_per_block=2, spatial_compression_ratio=32, sample_size=384, scaling_factor=0.75289),
       "tiny": dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 32, 32), layers_per_block=1,
                    spatial_compression_ratio=4, sample_size=64, scaling_factor=0.75289)}

# the pipeline's token counts (instance attributes it reads), for the tiny model
SEQUENCE = {"tiny": dict(tokenizer_max_length=25, tokenizer_2_max_length=16)}

GUIDANCE_SCALE = 3.5


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0, distilled: bool = False):
    from diffusers import HunyuanImageTransformer2DModel

    config = dict(TRANSFORMER[size], **(DISTILLED if distilled else {}))
    return build_module(lambda: HunyuanImageTransformer2DModel(**config), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int, distilled: bool = False):
    from diffusers import AdaptiveProjectedMixGuidance, AutoencoderKLHunyuanImage, FlowMatchEulerDiscreteScheduler, HunyuanImagePipeline
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    tokenizer, text_encoder = qwen25vl_text_encoder(QWEN25VL_TEXT[size], QWEN25VL_VISION[size], seed=seed + 1,
                                                    device=device, dtype=dtype)
    tokenizer_2 = ByT5Tokenizer()
    check_vocab(tokenizer_2, BYT5[size]["vocab_size"], "ByT5")
    guiders = {} if distilled else dict(guider=AdaptiveProjectedMixGuidance(guidance_scale=GUIDANCE_SCALE),
                                        ocr_guider=AdaptiveProjectedMixGuidance(guidance_scale=GUIDANCE_SCALE))
    pipe = HunyuanImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        vae=build_module(lambda: AutoencoderKLHunyuanImage(**VAE[size]), seed=seed + 2, device=device, dtype=dtype),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=build_module(lambda: T5EncoderModel(T5Config(**BYT5[size])), seed=seed + 3, device=device,
                                    dtype=dtype),
        tokenizer_2=tokenizer_2,
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed, distilled=distilled),
        **guiders,
    )
    for name, value in SEQUENCE.get(size, {}).items():  # full: the pipeline's own token counts
        setattr(pipe, name, value)
    pipe.prompt_template_encode_start_idx = template_prefix_tokens(tokenizer, pipe.prompt_template_encode)
    return pipe


# ---- the record ---------------------------------------------------------------------------------------------

class _ImageTokens(PlanHook):
    """Remembers the full image token count (x_embedder's output) for the block mask hook."""

    def post_forward(self, module, output):
        self.state.named["image"] = output.shape[1]
        return output


class _ShardedJointMask(PlanHook):
    """Blocks get ``attention_mask`` (batch, 1, 1, image + text) over the whole sequence; each rank's keys are
    [its image shard, its text shard], so the mask becomes [image part shard, text part shard]."""

    def pre_forward(self, module, *args, **kwargs):
        mask = kwargs.get("attention_mask")
        if mask is not None:
            image = self.state.named["image"]
            rank, world = self.state.rank, self.state.world
            kwargs["attention_mask"] = torch.cat(
                [sharding.shard(mask[..., :image], mask.dim() - 1, rank, world),
                 sharding.shard(mask[..., image:], mask.dim() - 1, rank, world)], dim=-1)
        return args, kwargs


def _sequence_plan(model: torch.nn.Module) -> SequenceParallelSpec:
    cpi, cpo = private.cp_types()
    blocks_of(model, "transformer_blocks")
    rope = rope_split(cpi, 0, 2)
    extra = [("x_embedder", _ImageTokens), ("transformer_blocks.*", _ShardedJointMask)]
    if len(getattr(model, "single_transformer_blocks", ())):
        extra.append(("single_transformer_blocks.*", _ShardedJointMask))
    return SequenceParallelSpec(
        cp_plan={
            "rope": rope,  # (cos, sin), (S_image, d)
            "transformer_blocks.0": {
                "hidden_states": cpi(split_dim=1, expected_dims=3),
                "encoder_hidden_states": cpi(split_dim=1, expected_dims=3),
            },
            "proj_out": cpo(gather_dim=1, expected_dims=3),
        },
        # the token refiner attends the whole prompt inside context_embedder, before the split
        local_attention=("context_embedder.*",),
        extra_hooks=extra,
    )


SPECS = (
    ModelSpec(
        name="tiny-hunyuanimage", family="hunyuanimage", size="tiny", kind="image", pipeline_class="HunyuanImagePipeline",
        patch_multiple=8, height=64, width=64, steps=2, guidance=1.0,  # guidance: its APG guiders (scale 3.5)
        description="HunyuanImage 2.1 architecture, 1+1 blocks, 4 heads x 16, Qwen2.5-VL + ByT5 text encoders, "
        "random weights",
    ),
    ModelSpec(
        name="full-hunyuanimage", family="hunyuanimage", size="full", kind="image", pipeline_class="HunyuanImagePipeline",
        patch_multiple=32, height=2048, width=2048, steps=50, guidance=1.0,  # guidance: its APG guiders
        description="HunyuanImage-2.1 dimensions (17B transformer: 20 + 40 blocks, 28 heads x 128), random weights",
    ),
)

RECORD = FamilyRecord(
    name="hunyuanimage", title="HunyuanImage 2.1", kind="image",
    pipelines={"HunyuanImagePipeline": "t2i"},
    transformers=("HunyuanImageTransformer2DModel",),
    sp=SequenceParallelFacts(plan_source="xstage", build=_sequence_plan, cfg=None),
    limits=SizeLimits(patch_multiple=32), specs=SPECS,
    latent_decode=latent_decode.scaled,
    build=build, build_transformer=build_transformer, transformer_dims=TRANSFORMER,
    real_weights_example="HunyuanImage-2.1-Diffusers", pipeline_worlds=(2, 4),
)
