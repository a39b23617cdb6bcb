"""FLUX.2 text-to-image (`Flux2Pipeline`), tiny: 1 double + 1 single block, 4 heads x 16, a 3-layer
Mistral-3 text encoder (language model and a 1-layer Pixtral vision tower) whose hidden states 1, 2 and 3
are stacked as FLUX.2 stacks 10, 20 and 30 (``text_encoder_out_layers``), a chat-template tokenizer in
code, the FLUX.2 VAE (2x2-patchified latents); random weights, CPU seconds.
"""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.tokenizers import qwen_tokenizer

OUT_LAYERS = (1, 2, 3)  # the pipeline's text_encoder_out_layers for the tiny encoder

TEXT = {"tiny": dict(vocab_size=2048, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=8, max_position_embeddings=1024)}
VISION = {"tiny": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=64,
                       patch_size=16, head_dim=8)}

TRANSFORMER = {
    "tiny": dict(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=4,
                 joint_attention_dim=len(OUT_LAYERS) * TEXT["tiny"]["hidden_size"], timestep_guidance_channels=16,
                 axes_dims_rope=(4, 4, 4, 4)),
}

VAE = {"tiny": dict(block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=4, norm_num_groups=4,
                    sample_size=64)}

# Mistral's chat format over messages whose content is a list of {"type": "text", "text": ...} parts.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
)


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    from diffusers import Flux2Transformer2DModel

    return build_module(lambda: Flux2Transformer2DModel(**TRANSFORMER[size]), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = qwen_tokenizer(1024, extra_special_tokens=("[IMG]",))
    tokenizer.chat_template = CHAT_TEMPLATE
    check_vocab(tokenizer, TEXT[size]["vocab_size"], "Mistral-3")
    config = Mistral3Config(text_config=dict(TEXT[size], model_type="mistral"),
                            vision_config=dict(VISION[size], model_type="pixtral"),
                            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"))
    return Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=build_module(lambda: AutoencoderKLFlux2(**VAE[size]), seed=seed + 2, device=device, dtype=dtype),
        text_encoder=build_module(lambda: Mistral3ForConditionalGeneration(config), seed=seed + 1, device=device,
                                  dtype=dtype),
        tokenizer=tokenizer,
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
    )
