"""FLUX.1: text-to-image (`FluxPipeline`), and with the same transformer class the image-conditioned pipelines:
FLUX.1 Kontext editing (`FluxKontextPipeline`), image-to-image (`FluxImg2ImgPipeline`) and FLUX.1 Fill inpainting
(`FluxFillPipeline`, a mask); tiny (CPU seconds) and full (FLUX.1-dev / Kontext-dev dimensions) built-ins.

Full size: transformer 19 double + 38 single blocks, 24 heads x 128, joint attention dim 4096 (T5-XXL),
pooled dim 768 (CLIP-L), guidance embedding; VAE 16 latent channels, 8x down; scheduler as FLUX.1-dev. Fill's
transformer takes 384 input channels (latents, masked-image latents and the 8x8 mask, packed) and returns 64.

The record: diffusers' own sequence plan, paired CFG (true CFG with a negative prompt; none for the
guidance-distilled FLUX.1-dev). Kontext appends the input image's latent tokens (and their ids) to the sequence
before the transformer: diffusers' plan splits the joined sequence at the transformer's entry, so the image tokens
are sharded with the rest and the pipeline keeps the first ``latents`` tokens of the gathered output.
"""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families import latent_decode
from xstage_dit.families.record import FamilyRecord, ImageInputFacts, SequenceParallelFacts, SizeLimits
from xstage_dit.families.sp_plan import shipped_plan
from xstage_dit.families.spec import ModelSpec
from xstage_dit.families.tokenizers import clip_tokenizer, t5_tokenizer

TRANSFORMER = {
    "full": dict(
        patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    ),
    "tiny": dict(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    ),
}
# FLUX.1 Fill: the same blocks over latents + masked-image latents + the packed 8x8 mask (4 * 64 channels)
TRANSFORMER["full-fill"] = dict(TRANSFORMER["full"], in_channels=64 + 64 + 256, out_channels=64)
TRANSFORMER["tiny-fill"] = dict(TRANSFORMER["tiny"], in_channels=16 + 16 + 256, out_channels=16)

VAE = {
    "full": dict(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False,
    ),
    # Four levels as in the real VAE, so the 8x spatial factor (and the 16-pixel patch multiple) is real.
    "tiny": dict(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 16, 16),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1, norm_num_groups=4, sample_size=64, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False,
    ),
}

CLIP = {
    "full": dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
                 projection_dim=768, bos_token_id=0, eos_token_id=1, pad_token_id=1),
    "tiny": dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, max_position_embeddings=77, hidden_act="quick_gelu",
                 projection_dim=32, bos_token_id=0, eos_token_id=1, pad_token_id=1),
}

T5 = {
    "full": dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                 feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
                 dense_act_fn="gelu_new", relative_attention_num_buckets=32),
    "tiny": dict(vocab_size=1024, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                 feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
                 dense_act_fn="gelu_new", relative_attention_num_buckets=8),
}

SCHEDULER = dict(
    num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
    base_image_seq_len=256, max_image_seq_len=4096,
)


#: variant -> its pipeline class ("": text-to-image)
PIPELINES = {"": "FluxPipeline", "kontext": "FluxKontextPipeline", "img2img": "FluxImg2ImgPipeline",
             "fill": "FluxFillPipeline"}


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0, variant: str = ""):
    """The `FluxTransformer2DModel` alone (what a denoising-step benchmark needs); Fill's has its own channels."""
    from diffusers import FluxTransformer2DModel

    config = TRANSFORMER[f"{size}-{variant}" if f"{size}-{variant}" in TRANSFORMER else size]
    return build_module(lambda: FluxTransformer2DModel(**config), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int, variant: str = ""):
    import diffusers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    if variant not in PIPELINES:
        raise ValueError(f"expected a FLUX.1 variant in {sorted(PIPELINES)}, got {variant!r}")

    tokenizer = clip_tokenizer(77)
    tokenizer_2 = t5_tokenizer(512)
    check_vocab(tokenizer, CLIP[size]["vocab_size"], "CLIP")
    check_vocab(tokenizer_2, T5[size]["vocab_size"], "T5")
    text_encoder = build_module(lambda: CLIPTextModel(CLIPTextConfig(**CLIP[size])), seed=seed + 1, device=device, dtype=dtype)
    text_encoder_2 = build_module(lambda: T5EncoderModel(T5Config(**T5[size])), seed=seed + 2, device=device, dtype=dtype)
    vae = build_module(lambda: AutoencoderKL(**VAE[size]), seed=seed + 3, device=device, dtype=dtype)
    transformer = build_transformer(size, dtype=dtype, device=device, seed=seed, variant=variant)
    return getattr(diffusers, PIPELINES[variant])(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


# ---- the record ---------------------------------------------------------------------------------------------

GUIDANCE_DISTILLED_KEY = "guidance_embeds"


def check_parallel(model: torch.nn.Module, config) -> None:
    """FLUX.1-dev is guidance-distilled: its pipeline runs one branch per step, nothing for cfg=2."""
    if config.cfg > 1 and getattr(model.config, GUIDANCE_DISTILLED_KEY, False):
        raise ValueError(
            "CFG parallel does not apply to guidance-distilled FLUX (guidance_embeds=True, e.g. FLUX.1-dev): its "
            f"pipeline runs one branch per step; expected cfg=1, got cfg={config.cfg}"
        )


SPECS = (
    ModelSpec(
        name="tiny-flux", family="flux", size="tiny", kind="image", pipeline_class="FluxPipeline",
        patch_multiple=16, height=128, width=128, steps=4, guidance=3.5, max_sequence_length=64,
        description="FLUX.1 architecture, 1+1 blocks, 2 heads x 16, random weights (CPU seconds)",
    ),
    ModelSpec(
        name="full-flux", family="flux", size="full", kind="image", pipeline_class="FluxPipeline",
        patch_multiple=16, height=1024, width=1024, steps=28, guidance=3.5, max_sequence_length=512,
        description="FLUX.1-dev dimensions (12B transformer: 19 double + 38 single blocks, 24 x 128), random weights",
    ),
)

# Kontext: output size from max_area (width * height asked), the input image's latents appended to the sequence.
# The tiny one keeps its input's size (_auto_resize off: diffusers would resize it to about 1024^2 on the CPU).
IMAGE_INPUTS = {
    # (it rounds its input down to 16 pixels: a smaller one would be 0 wide)
    "FluxKontextPipeline": ImageInputFacts(min_images=0, area_argument="max_area", min_side=16),
    "FluxImg2ImgPipeline": ImageInputFacts(),
    "FluxFillPipeline": ImageInputFacts(mask_argument="mask_image"),
}

SPECS += (
    ModelSpec(
        name="tiny-flux-kontext", family="flux", size="tiny", kind="image", pipeline_class="FluxKontextPipeline",
        variant="kontext", patch_multiple=16, height=128, width=128, steps=4, guidance=2.5, max_sequence_length=64,
        call_kwargs={"_auto_resize": False},
        description="FLUX.1 Kontext (image editing) architecture, 1+1 blocks, 2 heads x 16, random weights",
    ),
    ModelSpec(
        name="full-flux-kontext", family="flux", size="full", kind="image", pipeline_class="FluxKontextPipeline",
        variant="kontext", patch_multiple=16, height=1024, width=1024, steps=28, guidance=2.5,
        max_sequence_length=512,
        description="FLUX.1-Kontext-dev dimensions (12B transformer as FLUX.1-dev; the input image's 4096 tokens "
                    "appended at 1024^2), random weights",
    ),
    ModelSpec(
        name="tiny-flux-img2img", family="flux", size="tiny", kind="image", pipeline_class="FluxImg2ImgPipeline",
        variant="img2img", patch_multiple=16, height=128, width=128, steps=4, guidance=3.5, max_sequence_length=64,
        description="FLUX.1 image-to-image (strength 0.6) architecture, 1+1 blocks, 2 heads x 16, random weights",
    ),
    ModelSpec(
        name="tiny-flux-fill", family="flux", size="tiny", kind="image", pipeline_class="FluxFillPipeline",
        variant="fill", patch_multiple=16, height=128, width=128, steps=4, guidance=30.0, max_sequence_length=64,
        description="FLUX.1 Fill (inpainting with a mask) architecture, 1+1 blocks, 2 heads x 16, random weights",
    ),
    # also the defaults of a local FLUX.1-Fill-dev folder (its guidance 30)
    ModelSpec(
        name="full-flux-fill", family="flux", size="full", kind="image", pipeline_class="FluxFillPipeline",
        variant="fill", patch_multiple=16, height=1024, width=1024, steps=50, guidance=30.0, max_sequence_length=512,
        description="FLUX.1-Fill-dev dimensions (FLUX.1-dev's blocks over 384 input channels), random weights",
    ),
)

RECORD = FamilyRecord(
    name="flux", title="FLUX.1", kind="image",
    pipelines={"FluxPipeline": "t2i", "FluxKontextPipeline": "edit", "FluxImg2ImgPipeline": "i2i",
               "FluxFillPipeline": "inpaint"},
    image_inputs=IMAGE_INPUTS,
    transformers=("FluxTransformer2DModel",),
    sp=SequenceParallelFacts(plan_source="diffusers", build=shipped_plan(), check=check_parallel,
                             guidance_distilled_key=GUIDANCE_DISTILLED_KEY),
    limits=SizeLimits(patch_multiple=16), specs=SPECS,
    latent_decode=latent_decode.flux,
    build=build, build_transformer=build_transformer, transformer_dims=TRANSFORMER,
    real_weights_example="FLUX.1-dev", pipeline_worlds=(2, 4),
)
