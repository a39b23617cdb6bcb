"""LTX-Video text-to-video (`LTXPipeline`), tiny: a 1-block transformer, a 4-level LTX VAE (32x spatial,
8x temporal as in the real one), T5 text encoder; random weights, CPU seconds.

The pipeline pads the prompt to ``max_sequence_length`` and passes its mask, which the transformer
expands per head, ``(batch, heads, 1, text)``: the shape the sequence-parallel backend must take.
"""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.flux import T5
from xstage_dit.families.tokenizers import t5_tokenizer

TRANSFORMER = {
    "tiny": dict(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4,
                 attention_head_dim=8, cross_attention_dim=32, num_layers=1, caption_channels=32),
}

VAE = {
    "tiny": dict(in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
                 decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
                 decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, True, False),
                 decoder_spatio_temporal_scaling=(True, True, True, False),
                 decoder_inject_noise=(False, False, False, False, False), upsample_residual=(False,) * 4,
                 upsample_factor=(1, 1, 1, 1), patch_size=4, patch_size_t=1),
}

SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    from diffusers import LTXVideoTransformer3DModel

    return build_module(lambda: LTXVideoTransformer3DModel(**TRANSFORMER[size]), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline
    from transformers import T5Config, T5EncoderModel

    tokenizer = t5_tokenizer(128)
    check_vocab(tokenizer, T5[size]["vocab_size"], "T5")
    return LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=build_module(lambda: AutoencoderKLLTXVideo(**VAE[size]), seed=seed + 2, device=device, dtype=dtype),
        text_encoder=build_module(lambda: T5EncoderModel(T5Config(**T5[size])), seed=seed + 1, device=device,
                                  dtype=dtype),
        tokenizer=tokenizer,
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
    )
