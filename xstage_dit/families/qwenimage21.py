"""Qwen-Image 2.1 text-to-image (`QwenImage21Pipeline`), tiny: 2 single-stream block-causal blocks,
4 heads x 16, a 2-layer Qwen3-VL text encoder (language model and a 1-layer vision tower, as the real
class has one) behind the in-code Qwen3-VL processor of NucleusMoE, a 5-level Qwen-Image 2.1 VAE (16x
spatial as the real one: the pipeline hard-codes that factor); random weights, CPU seconds.

The pipeline prefills the text keys/values on its first step and decodes from that KV cache afterwards
(``use_kv_cache=True``, the default), runs true CFG as two calls with separate caches, and passes the
prompt padding mask (``encoder_hidden_states_mask``) only when a batch of prompts is padded.
"""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module
from xstage_dit.families.nucleusmoe import VISION, qwen3vl_text_encoder

TEXT = {
    # the pipeline reads hidden_states[-1] (before the final norm): 2 layers suffice
    "tiny": dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
                 rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[2, 3, 3],
                                      mrope_interleaved=True)),
}

TRANSFORMER = {
    "tiny": dict(patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
                 num_attention_heads=4, context_in_dim=TEXT["tiny"]["hidden_size"], mlp_ratio=2,
                 axes_dims_rope=(4, 6, 6)),
}

# five levels = four 2x downsamples: the 16x the pipeline assumes (vae_scale_factor = 16)
VAE = {
    "tiny": dict(base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
                 attn_scales=[], temperal_downsample=[False, True, True, True],
                 latents_mean=[0.51, 0.77, -0.06, 1.35], latents_std=[1.9, 1.7, 2.1, 1.6]),
}

SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=4096)


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    from diffusers import QwenImage21Transformer2DModel

    return build_module(lambda: QwenImage21Transformer2DModel(**TRANSFORMER[size]), seed=seed, device=device,
                        dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline

    proc, text_encoder = qwen3vl_text_encoder(TEXT[size], VISION[size], seed=seed + 1, device=device, dtype=dtype)
    return QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=build_module(lambda: AutoencoderKLQwenImage21(**VAE[size]), seed=seed + 2, device=device, dtype=dtype),
        text_encoder=text_encoder,
        processor=proc,
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
    )
