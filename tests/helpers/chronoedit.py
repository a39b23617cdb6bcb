"""ChronoEdit image editing as video (`ChronoEditPipeline`), tiny: 2 Wan-style blocks with the image
cross-attention (CLIP vision embeddings), 4 heads x 16, the tiny Wan VAE, UMT5 and a CLIP vision tower;
random weights, CPU seconds.

Not a registry model: its pipeline needs an input image, and the registry's models (CLI, server) are
text-to-image and text-to-video. Build it with ``build("tiny", dtype=..., device=..., seed=...)``.
"""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.tokenizers import t5_tokenizer
from xstage_dit.families.wan import UMT5, VAE

CLIP_VISION = {"tiny": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                            image_size=32, patch_size=16, projection_dim=16)}

TRANSFORMER = {
    # in_channels: noisy latents + the image condition (its latents and mask) as Wan I2V: 4 + 4 + 4
    "tiny": dict(num_attention_heads=4, attention_head_dim=16, in_channels=12, out_channels=4, text_dim=32, freq_dim=32,
                 ffn_dim=64, num_layers=2, image_dim=CLIP_VISION["tiny"]["hidden_size"], added_kv_proj_dim=64,
                 rope_max_seq_len=64),
}


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    from diffusers import ChronoEditTransformer3DModel

    return build_module(lambda: ChronoEditTransformer3DModel(**TRANSFORMER[size]), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    from diffusers import AutoencoderKLWan, ChronoEditPipeline, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    tokenizer = t5_tokenizer(512)
    check_vocab(tokenizer, UMT5[size]["vocab_size"], "UMT5")
    side = CLIP_VISION[size]["image_size"]
    return ChronoEditPipeline(
        tokenizer=tokenizer,
        text_encoder=build_module(lambda: UMT5EncoderModel(UMT5Config(**UMT5[size])), seed=seed + 1, device=device,
                                  dtype=dtype),
        image_encoder=build_module(lambda: CLIPVisionModel(CLIPVisionConfig(**CLIP_VISION[size])), seed=seed + 3,
                                   device=device, dtype=dtype),
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side}),
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
        vae=build_module(lambda: AutoencoderKLWan(**VAE[size]), seed=seed + 2, device=device, dtype=torch.float32),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
