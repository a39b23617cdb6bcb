"""NucleusMoE-Image text-to-image (`NucleusMoEImagePipeline`): tiny (CPU seconds) and full (Nucleus-Image).

Full size (the published Nucleus-Image config, 17B parameters, ~2B active): 32 blocks, 16 heads x 128
(2048 wide, 4 KV heads), first three blocks dense, then expert-choice MoE with 64 experts x 1344
(capacity factor 4, 4, then 2), joint attention dim 4096 from the Qwen3-VL-8B text encoder (hidden state
8th from the end); Qwen-Image VAE (16 latent channels, 8x). The Qwen3-VL vision tower is built too (the
real class has one) but the pipeline feeds it no image.
"""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.tokenizers import qwen_tokenizer

TRANSFORMER = {
    "full": dict(
        patch_size=2, in_channels=64, out_channels=16, num_layers=32, attention_head_dim=128, num_attention_heads=16,
        num_key_value_heads=4, joint_attention_dim=4096, axes_dims_rope=(16, 56, 56), mlp_ratio=4.0,
        moe_enabled=True, dense_moe_strategy="leave_first_three_blocks_dense", num_experts=64,
        moe_intermediate_dim=1344, capacity_factors=[0.0] * 3 + [4.0] * 2 + [2.0] * 27, use_sigmoid=False,
        route_scale=2.5, use_grouped_mm=True,
    ),
    "tiny": dict(
        # 64 wide, not less: the dense blocks' MLP width is int(dim * 8/3) rounded down to a multiple of 128.
        patch_size=2, in_channels=16, out_channels=4, num_layers=4, attention_head_dim=32, num_attention_heads=2,
        num_key_value_heads=1, joint_attention_dim=32, axes_dims_rope=(8, 12, 12), mlp_ratio=4.0,
        moe_enabled=True, dense_moe_strategy="leave_first_three_blocks_dense", num_experts=4,
        moe_intermediate_dim=32, capacity_factors=[0.0] * 3 + [4.0], use_sigmoid=False, route_scale=2.5,
        use_grouped_mm=True,
    ),
}

VAE = {
    "full": dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                 temperal_downsample=[False, True, True]),
    "tiny": dict(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
                 temperal_downsample=[False, True, True],
                 latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075], latents_std=[2.8184, 1.4541, 2.3275, 2.6558]),
}

TEXT = {
    "full": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                 rms_norm_eps=1e-6,
                 rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[24, 20, 20],
                                      mrope_interleaved=True)),
    # At least 8 layers: the pipeline reads hidden_states[-8].
    "tiny": dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
                 rms_norm_eps=1e-6,
                 rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[2, 3, 3],
                                      mrope_interleaved=True)),
}

VISION = {
    "full": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                 spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=4096, num_position_embeddings=2304,
                 deepstack_visual_indexes=[8, 16, 24]),
    "tiny": dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, patch_size=16, spatial_merge_size=2,
                 temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=64, deepstack_visual_indexes=[0]),
}

SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=4096)

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Qwen's chat format, enough for the pipeline's system + user text messages.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def processor():
    """A `Qwen3VLProcessor` over the in-code tokenizer and the PIL image processor, without a video processor.

    transformers' video processors require torchvision, which this project does not install; the
    text-to-image pipeline only tokenizes text, so the processor is built without one (calling it with
    videos raises).
    """
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor

    class TextImageQwen3VLProcessor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = qwen_tokenizer(4096, extra_special_tokens=VISION_TOKENS)
    return TextImageQwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2),
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=CHAT_TEMPLATE,
    )


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0, expert_shard=None):
    """The `NucleusMoEImageTransformer2DModel` alone (expert-choice MoE blocks included).

    Routed experts are drawn per (seed, layer, expert) (`xstage_dit.families.experts`); with
    ``expert_shard=(rank, world)`` only this rank's experts are made and the MoE layers are EP layers.
    """
    from diffusers import NucleusMoEImageTransformer2DModel

    from xstage_dit.families.experts import build_with_experts

    return build_with_experts(lambda: NucleusMoEImageTransformer2DModel(**TRANSFORMER[size]), "nucleusmoe", seed=seed,
                              shard=expert_shard, build_module=build_module, device=device, dtype=dtype)


def qwen3vl_text_encoder(text_config: dict, vision_config: dict, *, seed: int, device, dtype: torch.dtype):
    """(the Qwen3-VL processor with the in-code tokenizer, a ``Qwen3VLForConditionalGeneration`` of these
    configs with random weights): the text encoder of NucleusMoE and Qwen-Image 2.1."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    proc = processor()
    tok = proc.tokenizer
    check_vocab(tok, text_config["vocab_size"], "Qwen3-VL")
    config = Qwen3VLConfig(
        text_config=text_config, vision_config=vision_config,
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
    )
    return proc, build_module(lambda: Qwen3VLForConditionalGeneration(config), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int, expert_shard=None):
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, NucleusMoEImagePipeline

    proc, text_encoder = qwen3vl_text_encoder(TEXT[size], VISION[size], seed=seed + 1, device=device, dtype=dtype)
    vae = build_module(lambda: AutoencoderKLQwenImage(**VAE[size]), seed=seed + 2, device=device, dtype=dtype)
    return NucleusMoEImagePipeline(
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed, expert_shard=expert_shard),
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        processor=proc,
    )
