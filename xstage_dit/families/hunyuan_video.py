"""HunyuanVideo text-to-video (`HunyuanVideoPipeline`), tiny: 1 dual + 1 single block, 4 heads x 16, a
3-layer Llama text encoder (the pipeline reads the hidden state 3rd from the end) over the in-code Llama
tokenizer, a CLIP text encoder for the pooled prompt, the HunyuanVideo VAE with 3 levels (4x spatial,
4x temporal); random weights, CPU seconds.

The pipeline wraps the prompt in a chat template and drops its first ``crop_start`` tokens: the real
template's 95 are for the real tokenizer, so `PROMPT_TEMPLATE` carries the count for the in-code one
(the registry passes it as ``prompt_template``). It pads the prompt and passes its mask; guidance is embedded
(one call per step), true CFG with a negative prompt is a second call.
"""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.flux import CLIP
from xstage_dit.families.tokenizers import clip_tokenizer, llama_tokenizer

TEXT = {"tiny": dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                     num_key_value_heads=1, max_position_embeddings=1024)}

TRANSFORMER = {
    "tiny": dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=1,
                 num_single_layers=1, num_refiner_layers=1, text_embed_dim=TEXT["tiny"]["hidden_size"],
                 pooled_projection_dim=CLIP["tiny"]["hidden_size"], rope_axes_dim=(4, 6, 6)),
}

VAE = {"tiny": dict(latent_channels=4, block_out_channels=(8, 8, 8), layers_per_block=1, norm_num_groups=4,
                    down_block_types=("HunyuanVideoDownBlock3D",) * 3, up_block_types=("HunyuanVideoUpBlock3D",) * 3,
                    spatial_compression_ratio=4, temporal_compression_ratio=4, mid_block_add_attention=False)}

# A shorter system prompt than the real template's; crop_start = bos + the tokens before "{}" under the in-code
# Llama tokenizer (tests/families/test_models_families.py recounts it)
PROMPT_TEMPLATE = {
    "template": "<|start_header_id|>system<|end_header_id|>\n\nDescribe the video.<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>",
    "crop_start": 92,
}


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    from diffusers import HunyuanVideoTransformer3DModel

    return build_module(lambda: HunyuanVideoTransformer3DModel(**TRANSFORMER[size]), seed=seed, device=device,
                        dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    tokenizer, tokenizer_2 = llama_tokenizer(1024), clip_tokenizer()
    check_vocab(tokenizer, TEXT[size]["vocab_size"], "Llama")
    check_vocab(tokenizer_2, CLIP[size]["vocab_size"], "CLIP")
    return HunyuanVideoPipeline(
        text_encoder=build_module(lambda: LlamaModel(LlamaConfig(**TEXT[size])), seed=seed + 1, device=device,
                                  dtype=dtype),
        tokenizer=tokenizer,
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
        vae=build_module(lambda: AutoencoderKLHunyuanVideo(**VAE[size]), seed=seed + 2, device=device, dtype=dtype),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=build_module(lambda: CLIPTextModel(CLIPTextConfig(**CLIP[size])), seed=seed + 3, device=device,
                                    dtype=dtype),
        tokenizer_2=tokenizer_2,
    )
