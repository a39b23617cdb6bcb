"""Stable Diffusion 3 / 3.5 text-to-image (`StableDiffusion3Pipeline`), tiny: 2 joint blocks, the first
with SD3.5's extra self-attention (``dual_attention_layers``) and RMS q/k norms; two CLIP-with-projection
encoders and T5 (the pipeline joins 77 CLIP + T5 tokens); 8x VAE; random weights, CPU seconds.
"""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.flux import T5, VAE as FLUX_VAE
from xstage_dit.families.tokenizers import clip_tokenizer, t5_tokenizer

TRANSFORMER = {
    "tiny": dict(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
                 num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32,
                 pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm"),
}

CLIP = {
    "tiny": dict(vocab_size=2048, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=16, bos_token_id=0,
                 eos_token_id=1, pad_token_id=1),
}

VAE = {"tiny": dict(FLUX_VAE["tiny"], scaling_factor=1.5305, shift_factor=0.0609)}


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    from diffusers import SD3Transformer2DModel

    return build_module(lambda: SD3Transformer2DModel(**TRANSFORMER[size]), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tokenizer, tokenizer_3 = clip_tokenizer(77), t5_tokenizer(256)
    check_vocab(tokenizer, CLIP[size]["vocab_size"], "CLIP")
    check_vocab(tokenizer_3, T5[size]["vocab_size"], "T5")

    def clip(offset):
        return build_module(lambda: CLIPTextModelWithProjection(CLIPTextConfig(**CLIP[size])), seed=seed + offset,
                            device=device, dtype=dtype)

    return StableDiffusion3Pipeline(
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=build_module(lambda: AutoencoderKL(**VAE[size]), seed=seed + 4, device=device, dtype=dtype),
        text_encoder=clip(1), tokenizer=tokenizer, text_encoder_2=clip(2), tokenizer_2=clip_tokenizer(77),
        text_encoder_3=build_module(lambda: T5EncoderModel(T5Config(**T5[size])), seed=seed + 3, device=device,
                                    dtype=dtype),
        tokenizer_3=tokenizer_3,
    )
