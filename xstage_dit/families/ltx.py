"""LTX-Video text-to-video (`LTXPipeline`): tiny (a 1-block transformer, a 4-level LTX VAE: 32x spatial, 8x
temporal as in the real one, T5 text encoder; random weights, CPU seconds) and full (LTX-Video 0.9 dimensions:
the 2B transformer, 28 blocks, 32 heads x 64, cross-attention 2048, captions 4096 from T5-XXL; diffusers' class
defaults of `LTXVideoTransformer3DModel` and `AutoencoderKLLTXVideo` are that checkpoint's).

The pipeline pads the prompt to ``max_sequence_length`` and passes its mask, which the transformer
expands per head, ``(batch, heads, 1, text)``: the shape the sequence-parallel backend must take. The record:
diffusers' own sequence plan; no CFG parallel (the pipeline runs CFG as one (uncond, cond) batch).

Image-to-video (`LTXImageToVideoPipeline`, the same transformer): the first frame's latents replace the noise of
the first latent frame, whose tokens get timestep 0, so the transformer is handed per-token timesteps
``(batch, tokens)`` that its time embedding turns into per-token modulation; our plan adds that input to
diffusers' (split like the tokens where it is 2-D; the text-to-video pipeline's ``(batch,)`` stays whole).
The condition pipeline (`LTXConditionPipeline`, LTX-Video 0.9.5+), given an image at frame 0, does the same (its
conditioning mask makes the per-token timesteps) and hands the transformer its own video coordinates, from which
the rotary tables are made whole and then split by the same plan; conditions at later frames would add tokens in
front of the sequence, split with it (the product passes the first frame only).
"""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.flux import T5
from xstage_dit import _diffusers_private as private
from xstage_dit.families.record import FamilyRecord, ImageInputFacts, SequenceParallelFacts, SizeLimits
from xstage_dit.families.sp_plan import SequenceParallelSpec, shipped_plan
from xstage_dit.families.spec import ModelSpec
from xstage_dit.families.tokenizers import t5_tokenizer

TRANSFORMER = {
    "full": dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                 attention_head_dim=64, cross_attention_dim=2048, num_layers=28, caption_channels=4096),
    "tiny": dict(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4,
                 attention_head_dim=8, cross_attention_dim=32, num_layers=1, caption_channels=32),
}

VAE = {
    "full": dict(),  # the class defaults: LTX-Video 0.9's VAE (128 latent channels, 32x spatial, 8x temporal)
    "tiny": dict(in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
                 decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
                 decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, True, False),
                 decoder_spatio_temporal_scaling=(True, True, True, False),
                 decoder_inject_noise=(False, False, False, False, False), upsample_residual=(False,) * 4,
                 upsample_factor=(1, 1, 1, 1), patch_size=4, patch_size_t=1),
}

SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0, variant: str = ""):
    from diffusers import LTXVideoTransformer3DModel

    return build_module(lambda: LTXVideoTransformer3DModel(**TRANSFORMER[size]), seed=seed, device=device, dtype=dtype)


#: variant -> its pipeline class ("": text-to-video); the transformer is the same
PIPELINES = {"": "LTXPipeline", "i2v": "LTXImageToVideoPipeline", "condition": "LTXConditionPipeline"}


def build(size: str, *, dtype: torch.dtype, device, seed: int, variant: str = ""):
    import diffusers
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler
    from transformers import T5Config, T5EncoderModel

    if variant not in PIPELINES:
        raise ValueError(f"expected an LTX-Video variant in {sorted(PIPELINES)}, got {variant!r}")
    tokenizer = t5_tokenizer(128)
    check_vocab(tokenizer, T5[size]["vocab_size"], "T5")
    return getattr(diffusers, PIPELINES[variant])(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=build_module(lambda: AutoencoderKLLTXVideo(**VAE[size]), seed=seed + 2, device=device, dtype=dtype),
        text_encoder=build_module(lambda: T5EncoderModel(T5Config(**T5[size])), seed=seed + 1, device=device,
                                  dtype=dtype),
        tokenizer=tokenizer,
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
    )


SPECS = (
    ModelSpec(
        name="tiny-ltx", family="ltx", size="tiny", kind="video", pipeline_class="LTXPipeline",
        patch_multiple=32, height=64, width=96, frames=9, frame_multiple=8, steps=2, guidance=3.0,
        max_sequence_length=16, fps=24,
        description="LTX-Video architecture, 1 block, 4 heads x 8, LTX VAE (32x, 8x), random weights",
    ),
    ModelSpec(
        name="full-ltx", family="ltx", size="full", kind="video", pipeline_class="LTXPipeline",
        patch_multiple=32, height=512, width=704, frames=161, frame_multiple=8, steps=50, guidance=3.0,
        max_sequence_length=128, fps=25,
        description="LTX-Video 0.9 dimensions (2B transformer: 28 blocks, 32 heads x 64), random weights",
    ),
)

SPECS += (
    ModelSpec(
        name="tiny-ltx-condition", family="ltx", size="tiny", kind="video", pipeline_class="LTXConditionPipeline",
        variant="condition", patch_multiple=32, height=64, width=96, frames=9, frame_multiple=8, steps=2,
        guidance=3.0, max_sequence_length=16, fps=24,
        description="LTX-Video 0.9.5+ conditioning (an image at frame 0), 1 block, 4 heads x 8, LTX VAE, random weights",
    ),
    ModelSpec(
        name="tiny-ltx-i2v", family="ltx", size="tiny", kind="video", pipeline_class="LTXImageToVideoPipeline",
        variant="i2v", patch_multiple=32, height=64, width=96, frames=9, frame_multiple=8, steps=2, guidance=3.0,
        max_sequence_length=16, fps=24,
        description="LTX-Video image-to-video (first frame), 1 block, 4 heads x 8, LTX VAE, random weights",
    ),
)


def _sequence_plan(model: torch.nn.Module) -> SequenceParallelSpec:
    """diffusers' plan, and the image-to-video pipeline's per-token timesteps split like the tokens."""
    spec = shipped_plan()(model)
    cpi, _ = private.cp_types()
    spec.cp_plan[""] = dict(spec.cp_plan.get("", {}), timestep=cpi(split_dim=1, expected_dims=2))
    return spec


RECORD = FamilyRecord(
    name="ltx", title="LTX-Video", kind="video",
    pipelines={"LTXPipeline": "t2v", "LTXImageToVideoPipeline": "i2v", "LTXConditionPipeline": "i2v"},
    # the first frame, resized to the video's size; I2V: one copy per prompt (image[i] is encoded with
    # generator[i]); the condition pipeline: one prompt a call (a list of images is a list of conditions, and one
    # image's latents are drawn with the first prompt's generator)
    image_inputs={"LTXImageToVideoPipeline": ImageInputFacts(batch="per_prompt", size_from_image=False),
                  "LTXConditionPipeline": ImageInputFacts(batch="alone", size_from_image=False)},
    transformers=("LTXVideoTransformer3DModel",),
    sp=SequenceParallelFacts(plan_source="diffusers + per-token timesteps", build=_sequence_plan, cfg=None),
    limits=SizeLimits(patch_multiple=32, frame_multiple=8), specs=SPECS,
    build=build, build_transformer=build_transformer, transformer_dims=TRANSFORMER,
    real_weights_example="LTX-Video", pipeline_worlds=(2, 4),
)
