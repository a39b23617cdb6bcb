"""CogVideoX text-to-video (`CogVideoXPipeline`), tiny: 1 block with rotary positions (as CogVideoX-5B),
the CogVideoX VAE (8x spatial, 4x temporal), T5 text encoder; random weights, CPU seconds.

Its pipeline hands the transformer the rotary table of the whole video and one [text, video]
embedding that the transformer cuts in two outside any module (see `patches.family_plans`).
"""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.flux import T5
from xstage_dit.families.tokenizers import t5_tokenizer

TRANSFORMER = {
    "tiny": dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=16,
                 text_embed_dim=32, num_layers=1, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
                 temporal_compression_ratio=4, max_text_seq_length=16, use_rotary_positional_embeddings=True),
}

VAE = {
    "tiny": dict(in_channels=3, out_channels=3, block_out_channels=(8, 8, 8, 8), latent_channels=4,
                 layers_per_block=1, norm_num_groups=4, temporal_compression_ratio=4, sample_height=64,
                 sample_width=64),
}


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    from diffusers import CogVideoXTransformer3DModel

    return build_module(lambda: CogVideoXTransformer3DModel(**TRANSFORMER[size]), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline
    from transformers import T5Config, T5EncoderModel

    tokenizer = t5_tokenizer(226)
    check_vocab(tokenizer, T5[size]["vocab_size"], "T5")
    return CogVideoXPipeline(
        tokenizer=tokenizer,
        text_encoder=build_module(lambda: T5EncoderModel(T5Config(**T5[size])), seed=seed + 1, device=device,
                                  dtype=dtype),
        vae=build_module(lambda: AutoencoderKLCogVideoX(**VAE[size]), seed=seed + 2, device=device, dtype=dtype),
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
        scheduler=CogVideoXDDIMScheduler(timestep_spacing="trailing", rescale_betas_zero_snr=True,
                                         prediction_type="v_prediction"),
    )
