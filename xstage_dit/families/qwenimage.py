"""Qwen-Image text-to-image (`QwenImagePipeline`): tiny (1 block, 4 heads x 16, a Qwen2.5-VL text encoder
(language model and a 1-layer vision tower) over the in-code Qwen tokenizer, the tiny Qwen-Image VAE of
NucleusMoE; random weights, CPU seconds) and full (Qwen-Image dimensions, diffusers' class defaults: the 20B
transformer, 60 blocks, 24 heads x 128, joint attention 3584 from Qwen2.5-VL-7B; the Qwen-Image VAE).

The pipeline drops its prompt template's first 34 tokens and passes the prompt's padding mask
(``encoder_hidden_states_mask``); a batch of prompts of different lengths is padded. The record: diffusers'
own plan, paired CFG (true CFG with a negative prompt).

Image editing with the same transformer: Qwen-Image-Edit (`QwenImageEditPipeline`, one image) and Qwen-Image-Edit
2509 (`QwenImageEditPlusPipeline`, up to 3): the text encoder reads the prompt with the image(s) (a Qwen2.5-VL
processor: `_qwen2vl_processor`), and the images' latents (at about 1024^2 pixels each) are appended to the
sequence, with their own rotary positions, before the transformer: the plan shards them with the rest. Both
pipelines take one prompt a call.
"""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.nucleusmoe import QWEN_IMAGE_VAE, VAE, VISION_TOKENS
from xstage_dit.families import latent_decode
from xstage_dit.families.record import FamilyRecord, FeatureFacts, ImageInputFacts, SequenceParallelFacts, SizeLimits
from xstage_dit.families.sp_plan import shipped_plan
from xstage_dit.families.spec import ModelSpec
from xstage_dit.families.tokenizers import qwen_tokenizer, template_prefix_tokens

TRANSFORMER = {
    "full": dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56)),
    "tiny": dict(patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
                 num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)),
}

TEXT = {
    # Qwen2.5-VL-7B's language model
    "full": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6, rope_theta=1000000.0,
                 rope_scaling=dict(type="mrope", mrope_section=[16, 24, 24])),
    "tiny": dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=4096, rms_norm_eps=1e-6,
                 rope_scaling=dict(type="mrope", mrope_section=[2, 3, 3])),
}

VISION = {"full": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2, out_hidden_size=3584, window_size=112, fullatt_block_indexes=[7, 15, 23, 31]),
          "tiny": dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2, out_hidden_size=32, window_size=112, fullatt_block_indexes=[0])}


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0, variant: str = ""):
    from diffusers import QwenImageTransformer2DModel

    return build_module(lambda: QwenImageTransformer2DModel(**TRANSFORMER[size]), seed=seed, device=device, dtype=dtype)


def qwen25vl_text_encoder(text_config: dict, vision_config: dict | None, *, seed: int, device, dtype: torch.dtype):
    """(the in-code Qwen tokenizer with the vision tokens, a Qwen2.5-VL text encoder of these configs with random
    weights): ``Qwen2_5_VLForConditionalGeneration`` (language model and vision tower, as Qwen-Image and
    HunyuanImage 2.1 load it), or with ``vision_config=None`` the language model alone (``Qwen2_5_VLTextModel``,
    as HunyuanVideo 1.5 loads it)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    tokenizer = qwen_tokenizer(4096, extra_special_tokens=VISION_TOKENS)
    check_vocab(tokenizer, text_config["vocab_size"], "Qwen2.5-VL")
    # bos/eos in the in-code vocabulary (the config's defaults are the real one's 151643/151645)
    text_config = dict(text_config, bos_token_id=None, eos_token_id=tokenizer.eos_token_id)
    if vision_config is None:
        config = Qwen2_5_VLTextConfig(**text_config)
        return tokenizer, build_module(lambda: Qwen2_5_VLTextModel(config), seed=seed, device=device, dtype=dtype)
    config = Qwen2_5_VLConfig(
        text_config=text_config, vision_config=vision_config,
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
    )
    return tokenizer, build_module(lambda: Qwen2_5_VLForConditionalGeneration(config), seed=seed, device=device,
                                   dtype=dtype)


#: variant -> its pipeline class ("": text-to-image); the transformer is the same
PIPELINES = {"": "QwenImagePipeline", "edit": "QwenImageEditPipeline", "edit-plus": "QwenImageEditPlusPipeline"}
#: the vision tower's input of a tiny edit pipeline at most (the real processor's ~1M pixels is CPU minutes)
TINY_VISION_PIXELS = 112 * 112
_USER_TURN = "<|im_start|>user\n"


def _edit_processor(tokenizer, size: str):
    """The Qwen2.5-VL processor of an edit pipeline over `tokenizer` (the PIL image processor: no torchvision)."""
    from transformers import Qwen2VLImageProcessorPil

    from xstage_dit.families._qwen2vl_processor import TextImageQwen2VLProcessor

    patch, merge = VISION[size]["patch_size"], VISION[size]["spatial_merge_size"]
    bounds = {} if size == "full" else {"size": {"shortest_edge": (patch * merge) ** 2,
                                                 "longest_edge": TINY_VISION_PIXELS}}
    return TextImageQwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil(
        patch_size=patch, temporal_patch_size=VISION[size]["temporal_patch_size"], merge_size=merge, **bounds),
        tokenizer=tokenizer)


def build(size: str, *, dtype: torch.dtype, device, seed: int, variant: str = ""):
    import diffusers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler

    if variant not in PIPELINES:
        raise ValueError(f"expected a Qwen-Image variant in {sorted(PIPELINES)}, got {variant!r}")
    tokenizer, text_encoder = qwen25vl_text_encoder(TEXT[size], VISION[size], seed=seed + 1, device=device, dtype=dtype)
    extra = {} if not variant else {"processor": _edit_processor(tokenizer, size)}
    pipe = getattr(diffusers, PIPELINES[variant])(
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False),
        vae=build_module(lambda: AutoencoderKLQwenImage(**VAE[size]), seed=seed + 2, device=device, dtype=dtype),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
        **extra,
    )
    if variant:
        # the edit templates' literal 64 counts the real tokenizer's system turn; the in-code one's differs
        template = pipe.prompt_template_encode
        pipe.prompt_template_encode_start_idx = template_prefix_tokens(
            tokenizer, template[:template.index(_USER_TURN) + len(_USER_TURN)] + "{}")
    return pipe


# ---- the record ---------------------------------------------------------------------------------------------

SPECS = (
    ModelSpec(
        name="tiny-qwenimage", family="qwenimage", size="tiny", kind="image", pipeline_class="QwenImagePipeline",
        patch_multiple=16, height=64, width=64, steps=2, guidance=1.0, max_sequence_length=64,
        description="Qwen-Image architecture, 1 block, 4 heads x 16, Qwen2.5-VL text encoder, random weights",
    ),
    ModelSpec(
        name="full-qwenimage", family="qwenimage", size="full", kind="image", pipeline_class="QwenImagePipeline",
        patch_multiple=16, height=1328, width=1328, steps=50, guidance=1.0, max_sequence_length=512,
        description="Qwen-Image dimensions (20B transformer: 60 blocks, 24 heads x 128), Qwen2.5-VL-7B, random weights",
    ),
)

SPECS += (
    ModelSpec(
        name="tiny-qwenimage-edit", family="qwenimage", size="tiny", kind="image", pipeline_class="QwenImageEditPipeline",
        variant="edit", patch_multiple=16, height=64, width=64, steps=2, guidance=1.0, max_sequence_length=64,
        description="Qwen-Image-Edit architecture, 1 block, 4 heads x 16, Qwen2.5-VL reading the image, random weights",
    ),
    ModelSpec(
        name="tiny-qwenimage-edit-plus", family="qwenimage", size="tiny", kind="image",
        pipeline_class="QwenImageEditPlusPipeline", variant="edit-plus", patch_multiple=16, height=64, width=64,
        steps=2, guidance=1.0, max_sequence_length=64,
        description="Qwen-Image-Edit-2509 (1 to 3 images) architecture, 1 block, 4 heads x 16, random weights",
    ),
)

#: input images of Qwen-Image-Edit-2509 (its model card: multi-image editing with 1 to 3 images)
MAX_EDIT_PLUS_IMAGES = 3

RECORD = FamilyRecord(
    name="qwenimage", title="QwenImage", kind="image",
    pipelines={"QwenImagePipeline": "t2i", "QwenImageEditPipeline": "edit", "QwenImageEditPlusPipeline": "edit"},
    image_inputs={"QwenImageEditPipeline": ImageInputFacts(batch="alone"),
                  "QwenImageEditPlusPipeline": ImageInputFacts(max_images=MAX_EDIT_PLUS_IMAGES, as_list=True,
                                                               batch="alone")},
    transformers=("QwenImageTransformer2DModel",),
    sp=SequenceParallelFacts(plan_source="diffusers", build=shipped_plan()),
    limits=SizeLimits(patch_multiple=16), facts=FeatureFacts(video_vae=QWEN_IMAGE_VAE), specs=SPECS,
    latent_decode=latent_decode.qwenimage,
    build=build, build_transformer=build_transformer, transformer_dims=TRANSFORMER,
    real_weights_example="Qwen-Image", pipeline_worlds=(2, 4),
)
