"""Stable Diffusion 3 / 3.5 text-to-image (`StableDiffusion3Pipeline`): tiny (2 joint blocks, the first with
SD3.5's extra self-attention (``dual_attention_layers``) and RMS q/k norms; two CLIP-with-projection encoders
and T5, the pipeline joins 77 CLIP + T5 tokens; 8x VAE; random weights, CPU seconds) and full (SD3.5 Large
dimensions: 38 joint blocks, 38 heads x 64, caption projection 2432, RMS q/k norm; CLIP-L, CLIP-G, T5-XXL; the
16-channel SD3 VAE).

The record: our plan (the patch embedding and the context embedder split, joint attention over both shards);
SD3's processor calls SDPA itself, ours reproduces it with the xstage attention. No CFG parallel (the pipeline
runs CFG as one batch).
"""

from __future__ import annotations

import torch

from xstage_dit import _diffusers_private as private
from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.flux import CLIP as FLUX_CLIP, T5, VAE as FLUX_VAE
from xstage_dit.families import latent_decode
from xstage_dit.families.record import FamilyRecord, SequenceParallelFacts, SizeLimits
from xstage_dit.families.sp_plan import SequenceParallelSpec
from xstage_dit.families.spec import ModelSpec
from xstage_dit.families.tokenizers import clip_tokenizer, t5_tokenizer

TRANSFORMER = {
    "full": dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38, attention_head_dim=64,
                 num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                 pooled_projection_dim=2048, pos_embed_max_size=192, qk_norm="rms_norm"),
    "tiny": dict(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
                 num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32,
                 pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm"),
}

_TINY_CLIP = dict(vocab_size=2048, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=16, bos_token_id=0,
                  eos_token_id=1, pad_token_id=1)
# text_encoder (CLIP-L) and text_encoder_2 (CLIP-G: 1280 wide, 32 layers); the pooled projection is their 768 + 1280
CLIP = {"full": dict(FLUX_CLIP["full"]), "tiny": _TINY_CLIP}
CLIP_2 = {
    "full": dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
                 max_position_embeddings=77, hidden_act="gelu", projection_dim=1280, bos_token_id=0, eos_token_id=1,
                 pad_token_id=1),
    "tiny": _TINY_CLIP,
}

VAE = {"full": dict(FLUX_VAE["full"], scaling_factor=1.5305, shift_factor=0.0609),
       "tiny": dict(FLUX_VAE["tiny"], scaling_factor=1.5305, shift_factor=0.0609)}


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    from diffusers import SD3Transformer2DModel

    return build_module(lambda: SD3Transformer2DModel(**TRANSFORMER[size]), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tokenizer, tokenizer_3 = clip_tokenizer(77), t5_tokenizer(256)
    check_vocab(tokenizer, CLIP[size]["vocab_size"], "CLIP")
    check_vocab(tokenizer_3, T5[size]["vocab_size"], "T5")

    def clip(config, offset):
        return build_module(lambda: CLIPTextModelWithProjection(CLIPTextConfig(**config)), seed=seed + offset,
                            device=device, dtype=dtype)

    return StableDiffusion3Pipeline(
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=build_module(lambda: AutoencoderKL(**VAE[size]), seed=seed + 4, device=device, dtype=dtype),
        text_encoder=clip(CLIP[size], 1), tokenizer=tokenizer, text_encoder_2=clip(CLIP_2[size], 2),
        tokenizer_2=clip_tokenizer(77),
        text_encoder_3=build_module(lambda: T5EncoderModel(T5Config(**T5[size])), seed=seed + 3, device=device,
                                    dtype=dtype),
        tokenizer_3=tokenizer_3,
    )


# ---- the record ---------------------------------------------------------------------------------------------

def _sequence_plan(model: torch.nn.Module) -> SequenceParallelSpec:
    cpi, cpo = private.cp_types()
    return SequenceParallelSpec(
        cp_plan={
            # pos_embed adds the learned positions of the whole grid before this split
            "pos_embed": {0: cpi(split_dim=1, expected_dims=3, split_output=True)},
            "context_embedder": {0: cpi(split_dim=1, expected_dims=3, split_output=True)},
            "proj_out": cpo(gather_dim=1, expected_dims=3),
        },
        processor_swaps={
            "JointAttnProcessor2_0": "xstage_dit.features.sdpa_processors:XStageJointAttnProcessor.from_processor"},
    )


SPECS = (
    ModelSpec(
        name="tiny-sd3", family="sd3", size="tiny", kind="image", pipeline_class="StableDiffusion3Pipeline",
        patch_multiple=16, height=64, width=64, steps=2, guidance=7.0, max_sequence_length=16,
        description="SD3.5 architecture (a dual-attention block, RMS q/k norm), 2 blocks, 4 heads x 8, random weights",
    ),
    ModelSpec(
        name="full-sd3", family="sd3", size="full", kind="image", pipeline_class="StableDiffusion3Pipeline",
        patch_multiple=16, height=1024, width=1024, steps=28, guidance=3.5, max_sequence_length=256,
        description="Stable Diffusion 3.5 Large dimensions (8B transformer: 38 blocks, 38 heads x 64), random weights",
    ),
)

RECORD = FamilyRecord(
    name="sd3", title="SD3 / SD3.5", kind="image",
    pipelines={"StableDiffusion3Pipeline": "t2i"},
    transformers=("SD3Transformer2DModel",),
    sp=SequenceParallelFacts(plan_source="xstage", build=_sequence_plan, cfg=None),
    limits=SizeLimits(patch_multiple=16), specs=SPECS,
    latent_decode=latent_decode.scaled_shifted,
    build=build, build_transformer=build_transformer, transformer_dims=TRANSFORMER,
    real_weights_example="stable-diffusion-3.5-large", pipeline_worlds=(2, 4),
)
