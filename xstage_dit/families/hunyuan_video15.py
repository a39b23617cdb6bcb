"""HunyuanVideo 1.5 text-to-video (`HunyuanVideo15Pipeline`), tiny: 2 double-stream blocks, 4 heads x 16, a
3-layer Qwen2.5-VL language model (the pipeline reads the hidden state 3rd from the end) over the in-code Qwen
tokenizer and its chat template, a ByT5 glyph encoder (a 1-layer `T5EncoderModel` over transformers' own
byte-level `ByT5Tokenizer`, which needs no files), the HunyuanVideo 1.5 VAE with 3 levels (4x spatial, 4x
temporal), classifier-free guidance through the pipeline's guider; random weights, CPU seconds.

What the pipeline passes the transformer, every call: the latents with the (zero, for T2V) condition latents
and mask as channels, the LLM prompt padded to ``tokenizer_max_length`` with its mask, the ByT5 embedding of
the prompt's quoted text (glyphs; zeros and an all-zero mask when it quotes none) padded to
``tokenizer_2_max_length``, and ``vision_num_semantic_tokens`` zero image embeddings (masked out for T2V).
The transformer reorders them into [valid image, valid ByT5, valid LLM, padding] with one (batch, text) mask.
CFG is the guider's: two calls per step (cond, then the negative prompt).

The real pipeline hard-codes 1000 LLM / 256 ByT5 / 729 image tokens and crops the chat template's first 108
tokens (counted under the real tokenizer) as instance attributes; `build` sets them on the instance for the
tiny model (`SEQUENCE`) and counts the crop under the in-code tokenizer.
"""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.nucleusmoe import CHAT_TEMPLATE
from xstage_dit.families.qwenimage import TEXT as QWEN25VL_TEXT
from xstage_dit.families.qwenimage import qwen25vl_text_encoder
from xstage_dit.families.tokenizers import template_prefix_tokens

# the pipeline reads hidden_states[-3]: 3 layers
TEXT = {"tiny": dict(QWEN25VL_TEXT["tiny"], num_hidden_layers=3)}

# ByT5 (a T5 encoder over bytes): transformers' ByT5Tokenizer has 3 specials + 256 bytes + 125 extra ids = 384
BYT5 = {"tiny": dict(vocab_size=384, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                     feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False)}

# in_channels: latents + condition latents + mask (2 * latent_channels + 1), as the pipeline concatenates them
TRANSFORMER = {
    "tiny": dict(in_channels=9, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=2,
                 num_refiner_layers=1, text_embed_dim=TEXT["tiny"]["hidden_size"], text_embed_2_dim=BYT5["tiny"]["d_model"],
                 image_embed_dim=16, rope_axes_dim=(4, 6, 6), target_size=64, task_type="t2v"),
}

# 3 levels, the first two downsampling 2x in space and time: 4x spatial, 4x temporal
VAE = {"tiny": dict(latent_channels=4, block_out_channels=(8, 8, 8), layers_per_block=1, spatial_compression_ratio=4,
                    temporal_compression_ratio=4)}

# the pipeline's token counts (instance attributes it reads), for the tiny model: 24 LLM + 16 ByT5 + 9 image
SEQUENCE = {"tiny": dict(tokenizer_max_length=24, tokenizer_2_max_length=16, vision_num_semantic_tokens=9)}

GUIDANCE_SCALE = 6.0


def prompt_template(tokenizer, system_message: str) -> str:
    """The text the pipeline's chat template makes of a prompt, with ``{}`` where the prompt goes."""
    messages = [{"role": "system", "content": system_message}, {"role": "user", "content": "{}"}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    from diffusers import HunyuanVideo15Transformer3DModel

    return build_module(lambda: HunyuanVideo15Transformer3DModel(**TRANSFORMER[size]), seed=seed, device=device,
                        dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler,
                           HunyuanVideo15Pipeline)
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    tokenizer, text_encoder = qwen25vl_text_encoder(TEXT[size], None, seed=seed + 1, device=device, dtype=dtype)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer_2 = ByT5Tokenizer()
    check_vocab(tokenizer_2, BYT5[size]["vocab_size"], "ByT5")
    pipe = HunyuanVideo15Pipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
        vae=build_module(lambda: AutoencoderKLHunyuanVideo15(**VAE[size]), seed=seed + 2, device=device, dtype=dtype),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=build_module(lambda: T5EncoderModel(T5Config(**BYT5[size])), seed=seed + 3, device=device,
                                    dtype=dtype),
        tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=GUIDANCE_SCALE),
    )
    for name, value in SEQUENCE[size].items():
        setattr(pipe, name, value)
    pipe.prompt_template_encode_start_idx = template_prefix_tokens(tokenizer, prompt_template(tokenizer, pipe.system_message))
    return pipe
