"""Wan-VACE (`WanVACEPipeline`: text-to-video with a control video / reference images), tiny: 2 Wan blocks,
VACE hints at both, 4 heads, the tiny Wan VAE and UMT5; random weights, CPU seconds."""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.tokenizers import t5_tokenizer
from xstage_dit.families.wan import TRANSFORMER as WAN, UMT5, VAE

# VACE's control input: the VAE latents of the control video and of its mask, plus the packed mask (z_dim * 2 + 8 * 8)
# 4 heads (the tiny Wan has 2) so that sp=4 can split them
TRANSFORMER = {"tiny": dict(WAN["tiny"], num_attention_heads=4, vace_layers=[0, 1],
                           vace_in_channels=VAE["tiny"]["z_dim"] * 2 + 64)}


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    from diffusers import WanVACETransformer3DModel

    return build_module(lambda: WanVACETransformer3DModel(**TRANSFORMER[size]), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanVACEPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = t5_tokenizer(512)
    check_vocab(tokenizer, UMT5[size]["vocab_size"], "UMT5")
    return WanVACEPipeline(
        tokenizer=tokenizer,
        text_encoder=build_module(lambda: UMT5EncoderModel(UMT5Config(**UMT5[size])), seed=seed + 1, device=device,
                                  dtype=dtype),
        vae=build_module(lambda: AutoencoderKLWan(**VAE[size]), seed=seed + 2, device=device, dtype=torch.float32),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
    )
