"""Helios text-to-video (`HeliosPipeline`), tiny: 3 blocks (diffusers' own plan names exactly 40; ours
follows the model), 4 heads x 16, the tiny Wan VAE and UMT5; random weights, CPU seconds."""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.tokenizers import t5_tokenizer
from xstage_dit.families.wan import UMT5, VAE

TRANSFORMER = {
    "tiny": dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32,
                 freq_dim=32, ffn_dim=64, num_layers=3, rope_dim=(4, 6, 6)),
}


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    from diffusers import HeliosTransformer3DModel

    return build_module(lambda: HeliosTransformer3DModel(**TRANSFORMER[size]), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    from diffusers import AutoencoderKLWan, HeliosPipeline, HeliosScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = t5_tokenizer(512)
    check_vocab(tokenizer, UMT5[size]["vocab_size"], "UMT5")
    return HeliosPipeline(
        tokenizer=tokenizer,
        text_encoder=build_module(lambda: UMT5EncoderModel(UMT5Config(**UMT5[size])), seed=seed + 1, device=device,
                                  dtype=dtype),
        vae=build_module(lambda: AutoencoderKLWan(**VAE[size]), seed=seed + 2, device=device, dtype=torch.float32),
        scheduler=HeliosScheduler(stages=1, stage_range=[0, 1]),  # the plain (not pyramid) sampler
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
    )
