"""SkyReels-V2 (`SkyReelsV2DiffusionForcingPipeline`: diffusion forcing, per-frame noise levels and a
block-causal mask), tiny: 2 blocks, 4 heads, the tiny Wan VAE and UMT5; random weights, CPU seconds."""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.tokenizers import t5_tokenizer
from xstage_dit.families.wan import TRANSFORMER as WAN, UMT5, VAE

# 4 heads (the tiny Wan has 2) so that sp=4 can split them
TRANSFORMER = {"tiny": dict(WAN["tiny"], num_attention_heads=4, num_frame_per_block=1)}


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    from diffusers import SkyReelsV2Transformer3DModel

    return build_module(lambda: SkyReelsV2Transformer3DModel(**TRANSFORMER[size]), seed=seed, device=device,
                        dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    from diffusers import AutoencoderKLWan, SkyReelsV2DiffusionForcingPipeline, UniPCMultistepScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    from xstage_dit.families.wan import SCHEDULER

    tokenizer = t5_tokenizer(512)
    check_vocab(tokenizer, UMT5[size]["vocab_size"], "UMT5")
    return SkyReelsV2DiffusionForcingPipeline(
        tokenizer=tokenizer,
        text_encoder=build_module(lambda: UMT5EncoderModel(UMT5Config(**UMT5[size])), seed=seed + 1, device=device,
                                  dtype=dtype),
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
        vae=build_module(lambda: AutoencoderKLWan(**VAE[size]), seed=seed + 2, device=device, dtype=torch.float32),
        scheduler=UniPCMultistepScheduler(**SCHEDULER),
    )
