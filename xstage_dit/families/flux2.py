"""FLUX.2 text-to-image (`Flux2Pipeline`): tiny (1 double + 1 single block, 4 heads x 16, a 32-layer, 16-wide
Mistral-3 text encoder (language model and a 1-layer Pixtral vision tower) whose hidden states 10, 20 and 30
are stacked as the pipeline's default ``text_encoder_out_layers`` stacks them for FLUX.2, a chat-template
tokenizer in code, the FLUX.2 VAE (2x2-patchified latents); random weights, CPU seconds) and full (FLUX.2-dev
dimensions, diffusers' class defaults: the 32B transformer, 8 double + 48 single blocks, 48 heads x 128, joint
attention 15360 = 3 x 5120 from Mistral-Small-3.2-24B; the FLUX.2 VAE).

The record: diffusers' own plan, paired CFG; text depth skips the encoder layers past the deepest one read.
The same pipeline edits: up to `MAX_REFERENCES` reference images (``image=[...]``), whose latent tokens the pipeline
appends to the sequence (with their own position ids) before the transformer, which the plan shards with the rest.
"""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families import latent_decode
from xstage_dit.families.record import FamilyRecord, FeatureFacts, ImageInputFacts, SequenceParallelFacts, SizeLimits
from xstage_dit.families.sp_plan import shipped_plan
from xstage_dit.families.spec import ModelSpec
from xstage_dit.families.tokenizers import qwen_tokenizer

OUT_LAYERS = (10, 20, 30)  # the pipeline's default text_encoder_out_layers (FLUX.2-dev's)

TEXT = {
    # Mistral-Small-3.2-24B's language model
    "full": dict(vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=40, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5),
    # enough layers for the default out layers (a saved tiny folder runs with the pipeline's defaults), and a
    # couple past the deepest one read, as the real encoder has (it reads 30 of 40)
    "tiny": dict(vocab_size=2048, hidden_size=16, intermediate_size=32, num_hidden_layers=32, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8, max_position_embeddings=1024),
}
VISION = {
    # Pixtral (Mistral-Small-3.2's vision tower)
    "full": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, image_size=1540,
                 patch_size=14, head_dim=64),
    "tiny": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=64,
                 patch_size=16, head_dim=8),
}

TRANSFORMER = {
    "full": dict(in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128, num_attention_heads=48,
                 joint_attention_dim=len(OUT_LAYERS) * TEXT["full"]["hidden_size"], timestep_guidance_channels=256,
                 axes_dims_rope=(32, 32, 32, 32)),
    "tiny": dict(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=4,
                 joint_attention_dim=len(OUT_LAYERS) * TEXT["tiny"]["hidden_size"], timestep_guidance_channels=16,
                 axes_dims_rope=(4, 4, 4, 4)),
}

VAE = {"full": dict(),  # the class defaults: FLUX.2's VAE (32 latent channels, 2x2 patchified)
       "tiny": dict(block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=4, norm_num_groups=4,
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


# ---- the record ---------------------------------------------------------------------------------------------

def _read_indices(pipe, arguments: dict) -> list[int]:
    return list(arguments["text_encoder_out_layers"])


SPECS = (
    ModelSpec(
        name="tiny-flux2", family="flux2", size="tiny", kind="image", pipeline_class="Flux2Pipeline",
        patch_multiple=16, height=64, width=64, steps=2, guidance=4.0, max_sequence_length=32,
        description="FLUX.2 architecture, 1+1 blocks, 4 heads x 16, Mistral-3 text encoder, random weights",
    ),
    ModelSpec(
        name="full-flux2", family="flux2", size="full", kind="image", pipeline_class="Flux2Pipeline",
        patch_multiple=16, height=1024, width=1024, steps=50, guidance=4.0, max_sequence_length=512,
        description="FLUX.2-dev dimensions (32B transformer: 8 double + 48 single blocks, 48 heads x 128), "
        "Mistral-Small-3.2-24B, random weights",
    ),
)

#: reference images FLUX.2 [dev] takes (Black Forest Labs' model card: up to 10)
MAX_REFERENCES = 10

RECORD = FamilyRecord(
    name="flux2", title="FLUX.2", kind="image",
    pipelines={"Flux2Pipeline": "t2i"},
    # optional references, one list for every prompt; with no size the output takes the first one's (rounded)
    image_inputs={"Flux2Pipeline": ImageInputFacts(min_images=0, max_images=MAX_REFERENCES, as_list=True, min_side=64,
                                                   max_aspect=8)},  # Flux2ImageProcessor.check_image_input
    transformers=("Flux2Transformer2DModel",),
    sp=SequenceParallelFacts(plan_source="diffusers", build=shipped_plan()),
    limits=SizeLimits(patch_multiple=16), facts=FeatureFacts(text_read_indices=_read_indices), specs=SPECS,
    latent_decode=latent_decode.flux2,
    build=build, build_transformer=build_transformer, transformer_dims=TRANSFORMER,
    real_weights_example="FLUX.2-dev", pipeline_worlds=(2, 4),
)
