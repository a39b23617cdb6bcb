"""Z-Image text-to-image (`ZImagePipeline`), tiny: 1 main layer + 1 noise / 1 caption refiner, 6 heads
(not a power of two, like Z-Image's 30), a Qwen3 text encoder and a chat-template tokenizer in code, the
FLUX-style 8x VAE; random weights, CPU seconds.

The transformer pads image and caption to multiples of 32 tokens and builds one unified sequence with
a padding mask, so its attention always carries a (batch, seq) key mask.
"""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.flux import VAE as FLUX_VAE
from xstage_dit.families.tokenizers import qwen_tokenizer

TRANSFORMER = {
    "tiny": dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=48, n_layers=1, n_refiner_layers=1,
                 n_heads=6, n_kv_heads=6, cap_feat_dim=32, axes_dims=[2, 2, 4], axes_lens=[64, 32, 32]),
}

QWEN3 = {
    "tiny": dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, max_position_embeddings=512),
}

VAE = {"tiny": dict(FLUX_VAE["tiny"], scaling_factor=0.3611, shift_factor=0.1159)}

# Qwen3's chat format (what the pipeline's apply_chat_template call needs), without the thinking block.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    from diffusers import ZImageTransformer2DModel

    return build_module(lambda: ZImageTransformer2DModel(**TRANSFORMER[size]), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = qwen_tokenizer(512)
    tokenizer.chat_template = CHAT_TEMPLATE
    check_vocab(tokenizer, QWEN3[size]["vocab_size"], "Qwen3")
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=build_module(lambda: AutoencoderKL(**VAE[size]), seed=seed + 2, device=device, dtype=dtype),
        text_encoder=build_module(lambda: Qwen3Model(Qwen3Config(**QWEN3[size])), seed=seed + 1, device=device,
                                  dtype=dtype),
        tokenizer=tokenizer,
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
    )
