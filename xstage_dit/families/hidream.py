"""HiDream-I1 text-to-image (`HiDreamImagePipeline`): tiny (CPU seconds) and full (HiDream-I1-Full dimensions).

Full size: sparse-MoE transformer, 16 double + 32 single blocks, 20 heads x 128 (2560 wide), 4 routed
experts with 2 active plus a shared expert, caption channels 4096 (T5-XXL) and 4096 (Llama-3.1-8B, one
hidden layer per block), pooled text embedding 2048 (CLIP-L 768 + CLIP-G 1280); FLUX VAE.
"""

from __future__ import annotations

import torch

from xstage_dit.families import flux
from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.tokenizers import clip_tokenizer, llama_tokenizer, t5_tokenizer

# Llama hidden layer fed to each block: 32 layers, then the last one repeated (48 blocks in all).
FULL_LLAMA_LAYERS = list(range(32)) + [31] * 16

TRANSFORMER = {
    "full": dict(
        patch_size=2, in_channels=16, out_channels=16, num_layers=16, num_single_layers=32, attention_head_dim=128,
        num_attention_heads=20, caption_channels=[4096, 4096], text_emb_dim=2048, num_routed_experts=4,
        num_activated_experts=2, axes_dims_rope=(64, 32, 32), max_resolution=(128, 128),
        llama_layers=FULL_LLAMA_LAYERS,
    ),
    "tiny": dict(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, caption_channels=[32, 32], text_emb_dim=64, num_routed_experts=4,
        num_activated_experts=2, axes_dims_rope=(8, 4, 4), max_resolution=(32, 32), llama_layers=[0, 1],
    ),
}

# HiDream's CLIP encoders take 248 positions (long CLIP); the pipeline pads them to max_sequence_length.
CLIP_L = {
    "full": dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, max_position_embeddings=248, hidden_act="quick_gelu",
                 projection_dim=768, bos_token_id=0, eos_token_id=1, pad_token_id=1),
    "tiny": dict(flux.CLIP["tiny"], max_position_embeddings=248),
}
CLIP_G = {
    "full": dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                 num_attention_heads=20, max_position_embeddings=248, hidden_act="gelu",
                 projection_dim=1280, bos_token_id=0, eos_token_id=1, pad_token_id=1),
    "tiny": dict(flux.CLIP["tiny"], max_position_embeddings=248),
}
LLAMA = {
    "full": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                 rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=3),
    "tiny": dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=3),
}

TINY_SIDE_PX = 128

SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0, expert_shard=None):
    """The `HiDreamImageTransformer2DModel` alone (MoE feed-forward blocks included).

    Routed experts are drawn per (seed, layer, expert) (`xstage_dit.families.experts`); with
    ``expert_shard=(rank, world)`` only this rank's experts are made and the MoE layers are EP layers.
    """
    from diffusers import HiDreamImageTransformer2DModel

    from xstage_dit.families.experts import build_with_experts

    return build_with_experts(lambda: HiDreamImageTransformer2DModel(**TRANSFORMER[size]), "hidream", seed=seed,
                              shard=expert_shard, build_module=build_module, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int, expert_shard=None):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline
    from transformers import (CLIPTextConfig, CLIPTextModelWithProjection, LlamaConfig, LlamaForCausalLM,
                              T5Config, T5EncoderModel)

    tokenizer = clip_tokenizer(248)
    tokenizer_2 = clip_tokenizer(248)
    tokenizer_3 = t5_tokenizer(512)
    tokenizer_4 = llama_tokenizer(8192)
    check_vocab(tokenizer, CLIP_L[size]["vocab_size"], "CLIP-L")
    check_vocab(tokenizer_2, CLIP_G[size]["vocab_size"], "CLIP-G")
    check_vocab(tokenizer_3, flux.T5[size]["vocab_size"], "T5")
    check_vocab(tokenizer_4, LLAMA[size]["vocab_size"], "Llama")

    def llama():
        # Eager attention: the pipeline asks for attention weights (output_attentions=True).
        return LlamaForCausalLM(LlamaConfig(**LLAMA[size], attn_implementation="eager"))

    def kw(offset):
        return dict(seed=seed + offset, device=device, dtype=dtype)

    pipe = HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=build_module(lambda: AutoencoderKL(**flux.VAE[size]), **kw(5)),
        text_encoder=build_module(lambda: CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_L[size])), **kw(1)),
        tokenizer=tokenizer,
        text_encoder_2=build_module(lambda: CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_G[size])), **kw(2)),
        tokenizer_2=tokenizer_2,
        text_encoder_3=build_module(lambda: T5EncoderModel(T5Config(**flux.T5[size])), **kw(3)),
        tokenizer_3=tokenizer_3,
        text_encoder_4=build_module(llama, **kw(4)),
        tokenizer_4=tokenizer_4,
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed, expert_shard=expert_shard),
    )
    # HiDream rescales every request to the area (default_sample_size * 8)^2, keeping the aspect ratio
    # (1024^2 for the real model); the tiny model works at 128^2.
    pipe.default_sample_size = TINY_SIDE_PX // pipe.vae_scale_factor if size == "tiny" else 128
    return pipe
