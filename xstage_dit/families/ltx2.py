"""LTX-2 text-to-audio+video (`LTX2Pipeline`): tiny (a 1-block audio-video transformer, 4 heads x 8 for video,
4 x 8 for audio, the LTX-2 video VAE with one spatio-temporal level: 2x, 2x, the LTX-2 audio VAE and vocoder,
the text connectors, and a 2-layer Gemma-3 text encoder (language model and a 1-layer SigLIP vision tower, as
the real class has one) over the in-code Gemma tokenizer; random weights, CPU seconds) and full (LTX-2
dimensions, diffusers' class defaults: the 19B transformer, 48 blocks, video 32 heads x 128, audio 32 x 64,
captions 3840 from Gemma-3-12B; the class defaults of its VAEs, connectors and vocoder).

The pipeline pads the prompt to ``max_sequence_length`` (left, as Gemma) and passes the padding mask to
both streams; CFG is one call on a (uncond, cond) batch; spatio-temporal guidance (STG) and modality
isolation are extra calls per step. The record: diffusers' plan completed (the cross-modal rotary tables follow
the video shards; the audio stream stays whole on every rank), no CFG parallel.

Image-to-video (`LTX2ImageToVideoPipeline`, the same components): the image (re-compressed with H.264 as in
training, through PyAV) replaces the first latent frame, whose tokens get timestep 0: the video stream is handed
per-token timesteps ``(batch, video tokens)`` (the audio its own ``(batch,)``), which our plan splits like the
video tokens (the text-to-video pipeline's ``(batch,)`` stays whole).
"""

from __future__ import annotations

import torch

from xstage_dit import _diffusers_private as private
from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.record import FamilyRecord, ImageInputFacts, SequenceParallelFacts, SizeLimits
from xstage_dit.families.sp_plan import SequenceParallelSpec, rope_split
from xstage_dit.families.spec import ModelSpec
from xstage_dit.families.tokenizers import gemma_tokenizer

TEXT = {
    # Gemma-3-12B's language model
    "full": dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=256, max_position_embeddings=131072, sliding_window=1024),
    "tiny": dict(vocab_size=2048, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, sliding_window=64)}
VISION = {
    # SigLIP so400m at 896 (Gemma-3's vision tower)
    "full": dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, image_size=896,
                 patch_size=14),
    "tiny": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                       patch_size=7)}

MM_TOKENS_PER_IMAGE = {"full": 256, "tiny": 4}

TRANSFORMER = {
    "full": dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32, attention_head_dim=128,
                 cross_attention_dim=4096, audio_in_channels=128, audio_out_channels=128, audio_num_attention_heads=32,
                 audio_attention_head_dim=64, audio_cross_attention_dim=2048, num_layers=48,
                 caption_channels=TEXT["full"]["hidden_size"]),
    "tiny": dict(in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=4, attention_head_dim=8,
                 cross_attention_dim=32, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=4,
                 audio_attention_head_dim=8, audio_cross_attention_dim=32, num_layers=1,
                 caption_channels=TEXT["tiny"]["hidden_size"], rope_type="split", rope_double_precision=False),
}

# the connectors map the stacked text encoder states (embedding + every layer) back to the encoder width
# (their heads x head_dim must equal it), which the transformer projects to each stream
CONNECTORS = {
    "full": dict(caption_channels=TEXT["full"]["hidden_size"], text_proj_in_factor=TEXT["full"]["num_hidden_layers"] + 1),
    "tiny": dict(caption_channels=TEXT["tiny"]["hidden_size"], text_proj_in_factor=TEXT["tiny"]["num_hidden_layers"] + 1,
                 video_connector_num_attention_heads=4, video_connector_attention_head_dim=8,
                 video_connector_num_layers=1, video_connector_num_learnable_registers=None,
                 audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=8,
                 audio_connector_num_layers=1, audio_connector_num_learnable_registers=None,
                 connector_rope_base_seq_len=32, rope_double_precision=False, rope_type="split"),
}

# one spatio-temporal level (2x, 2x) after a 4x4 patchify: 8x spatial, 2x temporal
VAE = {
    "full": dict(),  # the class defaults: LTX-2's video VAE (128 latent channels, 32x spatial, 8x temporal)
    "tiny": dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,),
                 decoder_block_out_channels=(8,), layers_per_block=(1,), decoder_layers_per_block=(1, 1),
                 spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
                 decoder_inject_noise=(False, False), downsample_type=("spatial",), upsample_residual=(False,),
                 upsample_factor=(1,), timestep_conditioning=False, patch_size=4, patch_size_t=1,
                 encoder_causal=True, decoder_causal=False),
}

# audio latents are packed as latent_channels x mel_bins / 4 = 2 x 2 = the transformer's audio_in_channels
AUDIO_VAE = {
    "full": dict(),  # the class defaults: LTX-2's video VAE (128 latent channels, 32x spatial, 8x temporal)
    "tiny": dict(base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
                 resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
                 mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8),
}

VOCODER = {
    "full": dict(),  # the class defaults (24 kHz)
    "tiny": dict(in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
                 resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1,
                 output_sampling_rate=16000),
}


#: variant -> its pipeline class ("": text-to-audio+video); the components are the same
PIPELINES = {"": "LTX2Pipeline", "i2v": "LTX2ImageToVideoPipeline"}


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0, variant: str = ""):
    from diffusers import LTX2VideoTransformer3DModel

    return build_module(lambda: LTX2VideoTransformer3DModel(**TRANSFORMER[size]), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int, variant: str = ""):
    import diffusers
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    if variant not in PIPELINES:
        raise ValueError(f"expected an LTX-2 variant in {sorted(PIPELINES)}, got {variant!r}")
    tokenizer = gemma_tokenizer(1024)
    check_vocab(tokenizer, TEXT[size]["vocab_size"], "Gemma-3")
    config = Gemma3Config(text_config=dict(TEXT[size], model_type="gemma3_text"),
                          vision_config=dict(VISION[size], model_type="siglip_vision_model"),
                          mm_tokens_per_image=MM_TOKENS_PER_IMAGE[size])
    vae = build_module(lambda: AutoencoderKLLTX2Video(**VAE[size]), seed=seed + 2, device=device, dtype=dtype)
    if size == "tiny":  # decode all frames at once (the tiny VAE's frame-wise path would split 2 latent frames needlessly)
        vae.use_framewise_encoding = vae.use_framewise_decoding = False
    return getattr(diffusers, PIPELINES[variant])(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        audio_vae=build_module(lambda: AutoencoderKLLTX2Audio(**AUDIO_VAE[size]), seed=seed + 3, device=device,
                               dtype=dtype),
        text_encoder=build_module(lambda: Gemma3ForConditionalGeneration(config), seed=seed + 1, device=device,
                                  dtype=dtype),
        tokenizer=tokenizer,
        connectors=build_module(lambda: LTX2TextConnectors(**CONNECTORS[size]), seed=seed + 4, device=device,
                                dtype=dtype),
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
        vocoder=build_module(lambda: LTX2Vocoder(**VOCODER[size]), seed=seed + 5, device=device, dtype=dtype),
    )


# ---- the record ---------------------------------------------------------------------------------------------

def _sequence_plan(model: torch.nn.Module) -> SequenceParallelSpec:
    """diffusers' LTX-2 plan, completed: the rotary tables of the cross-modal attentions follow the video
    shards too, and the tables' sequence dim is the one of the model's rope type ("split" tables are
    (batch, heads, seq, d/2), "interleaved" ones (batch, seq, d)). Audio queries and keys are whole on
    every rank, so the attentions whose keys are audio (or audio text) are local ("replicated")."""
    cpi, cpo = private.cp_types()
    shipped = private.shipped_cp_plan(type(model)) or {}
    if "" not in shipped or "proj_out" not in shipped:
        raise ValueError(f"expected LTX-2's _cp_plan to split at the root and gather at proj_out, got {sorted(shipped)}")
    split_rope = getattr(model.config, "rope_type", "interleaved") == "split"
    dim, dims = (2, 4) if split_rope else (1, 3)
    rope = rope_split(cpi, dim, dims)
    # image-to-video: the video's per-token timesteps (batch, video tokens) split like its tokens
    root = dict(shipped[""], timestep=cpi(split_dim=1, expected_dims=2))
    plan = {"": root, "rope": rope, "cross_attn_rope": dict(rope), "proj_out": shipped["proj_out"]}
    return SequenceParallelSpec(
        cp_plan=plan,
        kv_layouts={
            "transformer_blocks.*.audio_attn1": "replicated",
            "transformer_blocks.*.audio_attn2": "replicated",
            "transformer_blocks.*.audio_to_video_attn": "replicated",
        },
    )


SPECS = (
    ModelSpec(
        name="tiny-ltx2", family="ltx2", size="tiny", kind="video", pipeline_class="LTX2Pipeline",
        patch_multiple=32, height=32, width=32, frames=5, frame_multiple=2, steps=2, guidance=3.0,
        max_sequence_length=16, fps=24,
        call_kwargs={"spatio_temporal_guidance_blocks": [0]},  # the tiny model's one block (LTX-2: 28)
        description="LTX-2 audio+video architecture, 1 block, 4 heads x 8 per stream, Gemma-3 text encoder, "
        "LTX-2 video/audio VAEs and vocoder, random weights (the audio is not written)",
    ),
    ModelSpec(
        name="full-ltx2", family="ltx2", size="full", kind="video", pipeline_class="LTX2Pipeline",
        patch_multiple=32, height=512, width=768, frames=121, frame_multiple=8, steps=30, guidance=3.0,
        max_sequence_length=1024, fps=24,
        description="LTX-2 dimensions (19B audio+video transformer: 48 blocks, 32 heads x 128 video, 32 x 64 audio), "
        "Gemma-3-12B, random weights (the audio is not written)",
    ),
)

SPECS += (
    ModelSpec(
        name="tiny-ltx2-i2v", family="ltx2", size="tiny", kind="video", pipeline_class="LTX2ImageToVideoPipeline",
        variant="i2v", patch_multiple=32, height=32, width=32, frames=5, frame_multiple=2, steps=2, guidance=3.0,
        max_sequence_length=16, fps=24, call_kwargs={"spatio_temporal_guidance_blocks": [0]},
        description="LTX-2 image-to-video (first frame), 1 block, 4 heads x 8 per stream, random weights",
    ),
)

RECORD = FamilyRecord(
    name="ltx2", title="LTX-2", kind="video",
    pipelines={"LTX2Pipeline": "t2v", "LTX2ImageToVideoPipeline": "i2v"},
    # the first frame, resized to the video's size; one prompt a call (the H.264 round trip takes one image, which
    # the pipeline then encodes once per generator)
    image_inputs={"LTX2ImageToVideoPipeline": ImageInputFacts(batch="alone", size_from_image=False)},
    transformers=("LTX2VideoTransformer3DModel",),
    sp=SequenceParallelFacts(plan_source="diffusers (completed: cross-modal rotary, audio local)", build=_sequence_plan,
                             cfg=None),
    limits=SizeLimits(patch_multiple=32, frame_multiple=8), specs=SPECS,
    build=build, build_transformer=build_transformer, transformer_dims=TRANSFORMER,
    real_weights_example="LTX-2", pipeline_worlds=(2, 4),
)
