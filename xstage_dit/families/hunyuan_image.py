"""HunyuanImage 2.1 text-to-image (`HunyuanImagePipeline`), tiny: 1 double + 1 single block, 4 heads x 16, a
Qwen2.5-VL text encoder (3 layers: the pipeline reads the hidden state 3rd from the end; a 1-layer vision
tower, as the real class has one) over the in-code Qwen tokenizer, a ByT5 glyph encoder (the tiny T5 encoder of
HunyuanVideo 1.5 over transformers' file-less `ByT5Tokenizer`), the HunyuanImage VAE with 3 levels (4x
spatial); random weights, CPU seconds. The refiner pipeline is not built.

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
"""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.hunyuan_video15 import BYT5
from xstage_dit.families.hunyuan_video15 import TEXT as QWEN25VL_TEXT_3_LAYERS
from xstage_dit.families.qwenimage import VISION as QWEN25VL_VISION
from xstage_dit.families.qwenimage import qwen25vl_text_encoder
from xstage_dit.families.tokenizers import template_prefix_tokens

TRANSFORMER = {
    "tiny": dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=1,
                 num_single_layers=1, num_refiner_layers=1, text_embed_dim=QWEN25VL_TEXT_3_LAYERS["tiny"]["hidden_size"],
                 text_embed_2_dim=BYT5["tiny"]["d_model"], rope_axes_dim=(8, 8)),
}
DISTILLED = dict(guidance_embeds=True, use_meanflow=True)  # HunyuanImage-2.1-Distilled

# 3 levels, two 2x downsamples; 32 channels: its GroupNorms have 32 groups. The class has no default
# scaling_factor (None), which the pipeline divides by: the published VAE's
VAE = {"tiny": dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 32, 32), layers_per_block=1,
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

    tokenizer, text_encoder = qwen25vl_text_encoder(QWEN25VL_TEXT_3_LAYERS[size], QWEN25VL_VISION[size], seed=seed + 1,
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
    for name, value in SEQUENCE[size].items():
        setattr(pipe, name, value)
    pipe.prompt_template_encode_start_idx = template_prefix_tokens(tokenizer, pipe.prompt_template_encode)
    return pipe
