"""CogVideoX text-to-video (`CogVideoXPipeline`): tiny (1 block with rotary positions as CogVideoX-5B, the
CogVideoX VAE: 8x spatial, 4x temporal, T5 text encoder; random weights, CPU seconds) and full (CogVideoX-5b
dimensions: 42 blocks, 48 heads x 64, rotary positions, T5-XXL; its VAE with scaling factor 0.7).

Its pipeline hands the transformer the rotary table of the whole video and one [text, video]
embedding that the transformer cuts in two outside any module: our plan splits both at the first block.
CogVideoX's processor calls SDPA itself; ours reproduces it with the xstage attention. No CFG parallel (the
pipeline runs CFG as one batch).

Image-to-video (`CogVideoXImageToVideoPipeline`, CogVideoX-5b-I2V): the image's latents (first frame, zeros after)
are concatenated to the noise on channels (a 32-channel patch embedding), so they shard with the video tokens.
"""

from __future__ import annotations

import torch

from xstage_dit import _diffusers_private as private
from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.flux import T5
from xstage_dit.families.record import FamilyRecord, ImageInputFacts, SequenceParallelFacts, SizeLimits
from xstage_dit.families.sp_plan import SequenceParallelSpec, blocks_of
from xstage_dit.families.spec import ModelSpec
from xstage_dit.families.tokenizers import t5_tokenizer

TRANSFORMER = {
    "full": dict(num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16, time_embed_dim=512,
                 text_embed_dim=4096, num_layers=42, sample_width=90, sample_height=60, sample_frames=49, patch_size=2,
                 temporal_compression_ratio=4, max_text_seq_length=226, use_rotary_positional_embeddings=True),
    "tiny": dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=16,
                 text_embed_dim=32, num_layers=1, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
                 temporal_compression_ratio=4, max_text_seq_length=16, use_rotary_positional_embeddings=True),
}
# image-to-video: the noise and the image's latents, concatenated on channels
TRANSFORMER["full-i2v"] = dict(TRANSFORMER["full"], in_channels=32)
TRANSFORMER["tiny-i2v"] = dict(TRANSFORMER["tiny"], in_channels=8)

VAE = {
    "full": dict(scaling_factor=0.7),  # the class defaults are the CogVideoX VAE; 5b scales its latents by 0.7
    "tiny": dict(in_channels=3, out_channels=3, block_out_channels=(8, 8, 8, 8), latent_channels=4,
                 layers_per_block=1, norm_num_groups=4, temporal_compression_ratio=4, sample_height=64,
                 sample_width=64),
}


#: variant -> its pipeline class ("": text-to-video)
PIPELINES = {"": "CogVideoXPipeline", "i2v": "CogVideoXImageToVideoPipeline"}


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0, variant: str = ""):
    from diffusers import CogVideoXTransformer3DModel

    config = TRANSFORMER[f"{size}-{variant}" if variant else size]
    return build_module(lambda: CogVideoXTransformer3DModel(**config), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int, variant: str = ""):
    import diffusers
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler
    from transformers import T5Config, T5EncoderModel

    if variant not in PIPELINES:
        raise ValueError(f"expected a CogVideoX variant in {sorted(PIPELINES)}, got {variant!r}")
    tokenizer = t5_tokenizer(226)
    check_vocab(tokenizer, T5[size]["vocab_size"], "T5")
    return getattr(diffusers, PIPELINES[variant])(
        tokenizer=tokenizer,
        text_encoder=build_module(lambda: T5EncoderModel(T5Config(**T5[size])), seed=seed + 1, device=device,
                                  dtype=dtype),
        vae=build_module(lambda: AutoencoderKLCogVideoX(**VAE[size]), seed=seed + 2, device=device, dtype=dtype),
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed, variant=variant),
        scheduler=CogVideoXDDIMScheduler(timestep_spacing="trailing", rescale_betas_zero_snr=True,
                                         prediction_type="v_prediction"),
    )


# ---- the record ---------------------------------------------------------------------------------------------

def _sequence_plan(model: torch.nn.Module) -> SequenceParallelSpec:
    """One [text, video] embedding, cut in two outside any module: both halves split at the first block."""
    cpi, cpo = private.cp_types()
    blocks_of(model, "transformer_blocks")
    rope = [cpi(split_dim=0, expected_dims=2), cpi(split_dim=0, expected_dims=2)]  # (cos, sin), (S_video, d)
    return SequenceParallelSpec(
        cp_plan={
            "transformer_blocks.0": {
                "hidden_states": cpi(split_dim=1, expected_dims=3),
                "encoder_hidden_states": cpi(split_dim=1, expected_dims=3),
            },
            # the forward hands the whole rotary table to every block
            "transformer_blocks.*": {"image_rotary_emb": rope},
            "norm_final": cpo(gather_dim=1, expected_dims=3),
        },
        processor_swaps={
            "CogVideoXAttnProcessor2_0": "xstage_dit.features.sdpa_processors:XStageCogVideoXAttnProcessor.from_processor"},
    )


SPECS = (
    ModelSpec(
        name="tiny-cogvideox", family="cogvideox", size="tiny", kind="video", pipeline_class="CogVideoXPipeline",
        patch_multiple=16, height=64, width=64, frames=9, frame_multiple=4, steps=2, guidance=6.0,
        max_sequence_length=16, fps=8,
        description="CogVideoX-5B style (rotary positions), 1 block, 4 heads x 16, random weights",
    ),
    ModelSpec(
        name="full-cogvideox", family="cogvideox", size="full", kind="video", pipeline_class="CogVideoXPipeline",
        patch_multiple=16, height=480, width=720, frames=49, frame_multiple=4, steps=50, guidance=6.0,
        max_sequence_length=226, fps=8,
        description="CogVideoX-5b dimensions (42 blocks, 48 heads x 64, rotary positions), random weights",
    ),
)

SPECS += (
    ModelSpec(
        name="tiny-cogvideox-i2v", family="cogvideox", size="tiny", kind="video",
        pipeline_class="CogVideoXImageToVideoPipeline", variant="i2v", patch_multiple=16, height=64, width=64,
        frames=9, frame_multiple=4, steps=2, guidance=6.0, max_sequence_length=16, fps=8,
        description="CogVideoX-5B-I2V style (image latents on channels), 1 block, 4 heads x 16, random weights",
    ),
)

RECORD = FamilyRecord(
    name="cogvideox", title="CogVideoX", kind="video",
    pipelines={"CogVideoXPipeline": "t2v", "CogVideoXImageToVideoPipeline": "i2v"},
    # the first frame, resized to the video's size; one copy per prompt (image[i] is encoded with generator[i])
    image_inputs={"CogVideoXImageToVideoPipeline": ImageInputFacts(batch="per_prompt", size_from_image=False)},
    transformers=("CogVideoXTransformer3DModel",),
    sp=SequenceParallelFacts(plan_source="xstage", build=_sequence_plan, cfg=None),
    limits=SizeLimits(patch_multiple=16, frame_multiple=4), specs=SPECS,
    build=build, build_transformer=build_transformer, transformer_dims=TRANSFORMER,
    real_weights_example="CogVideoX-5b", pipeline_worlds=(2, 4),
)
