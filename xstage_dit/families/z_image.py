"""Z-Image text-to-image (`ZImagePipeline`): tiny (1 main layer + 1 noise / 1 caption refiner, 6 heads (not a
power of two, like Z-Image's 30), a Qwen3 text encoder and a chat-template tokenizer in code, the FLUX-style 8x
VAE; random weights, CPU seconds) and full (Z-Image-Turbo dimensions, diffusers' class defaults: 30 layers + 2
refiners, 3840 wide, 30 heads x 128; the Qwen3-4B text encoder; the FLUX VAE).

The transformer pads image and caption to multiples of 32 tokens and builds one unified sequence with
a padding mask, so its attention always carries a (batch, seq) key mask. The record: our plan (the unified
sequence split at the first main layer; the refiners attend their own whole piece before it), no CFG parallel.
"""

from __future__ import annotations

import torch

from xstage_dit import _diffusers_private as private
from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.flux import VAE as FLUX_VAE
from xstage_dit.families import latent_decode
from xstage_dit.families.record import FamilyRecord, SequenceParallelFacts, SizeLimits
from xstage_dit.families.sp_plan import SequenceParallelSpec, blocks_of
from xstage_dit.families.spec import ModelSpec
from xstage_dit.families.tokenizers import qwen_tokenizer

TRANSFORMER = {
    "full": dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
                 n_heads=30, n_kv_heads=30, cap_feat_dim=2560, axes_dims=[32, 48, 48], axes_lens=[1024, 512, 512]),
    "tiny": dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=48, n_layers=1, n_refiner_layers=1,
                 n_heads=6, n_kv_heads=6, cap_feat_dim=32, axes_dims=[2, 2, 4], axes_lens=[64, 32, 32]),
}

QWEN3 = {
    # Qwen3-4B
    "full": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                 tie_word_embeddings=True),
    "tiny": dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, max_position_embeddings=512),
}

VAE = {"full": dict(FLUX_VAE["full"]), "tiny": dict(FLUX_VAE["tiny"], scaling_factor=0.3611, shift_factor=0.1159)}

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


# ---- the record ---------------------------------------------------------------------------------------------

def _sequence_plan(model: torch.nn.Module) -> SequenceParallelSpec:
    """Refiners on whole pieces, then one unified [image, caption] sequence split at the first main layer."""
    cpi, cpo = private.cp_types()
    blocks_of(model, "layers")
    return SequenceParallelSpec(
        cp_plan={
            "layers.0": {"x": cpi(split_dim=1, expected_dims=3)},
            # the unified mask (batch, seq), rotary table (batch, seq, d/2) and omni noise mask go to every layer
            "layers.*": {
                "attn_mask": cpi(split_dim=1, expected_dims=2),
                "freqs_cis": cpi(split_dim=1, expected_dims=3),
                "noise_mask": cpi(split_dim=1, expected_dims=2),
            },
            "all_final_layer.*": cpo(gather_dim=1, expected_dims=3),
        },
        # the noise / caption / SigLIP refiners attend their own whole piece, before the split
        local_attention=("noise_refiner.*", "context_refiner.*", "siglip_refiner.*"),
    )


SPECS = (
    ModelSpec(
        name="tiny-z-image", family="z-image", size="tiny", kind="image", pipeline_class="ZImagePipeline",
        patch_multiple=16, height=64, width=64, steps=2, guidance=0.0, max_sequence_length=32,
        description="Z-Image architecture, 1 layer + refiners, 6 heads x 8, Qwen3 text encoder, random weights",
    ),
    ModelSpec(
        name="full-z-image", family="z-image", size="full", kind="image", pipeline_class="ZImagePipeline",
        patch_multiple=16, height=1024, width=1024, steps=9, guidance=0.0, max_sequence_length=512,
        description="Z-Image-Turbo dimensions (6B transformer: 30 layers, 30 heads x 128), Qwen3-4B, random weights",
    ),
)

RECORD = FamilyRecord(
    name="z-image", title="Z-Image", kind="image",
    pipelines={"ZImagePipeline": "t2i"},
    transformers=("ZImageTransformer2DModel",),
    sp=SequenceParallelFacts(plan_source="xstage", build=_sequence_plan, cfg=None, heads_key="n_heads"),
    limits=SizeLimits(patch_multiple=16), specs=SPECS,
    latent_decode=latent_decode.scaled_shifted,
    build=build, build_transformer=build_transformer, transformer_dims=TRANSFORMER,
    real_weights_example="Z-Image-Turbo", pipeline_worlds=(2, 4),
)
