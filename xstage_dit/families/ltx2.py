"""LTX-2 text-to-audio+video (`LTX2Pipeline`), tiny: a 1-block audio-video transformer (4 heads x 8 for
video, 4 x 8 for audio), the LTX-2 video VAE (one spatio-temporal level: 2x, 2x), the LTX-2 audio VAE and
vocoder, the text connectors, and a 2-layer Gemma-3 text encoder (language model and a 1-layer SigLIP
vision tower, as the real class has one) over the in-code Gemma tokenizer; random weights, CPU seconds.

The pipeline pads the prompt to ``max_sequence_length`` (left, as Gemma) and passes the padding mask to
both streams; CFG is one call on a (uncond, cond) batch; spatio-temporal guidance (STG) and modality
isolation are extra calls per step.
"""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.tokenizers import gemma_tokenizer

TEXT = {"tiny": dict(vocab_size=2048, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, sliding_window=64)}
VISION = {"tiny": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                       patch_size=7)}

TRANSFORMER = {
    "tiny": dict(in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=4, attention_head_dim=8,
                 cross_attention_dim=32, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=4,
                 audio_attention_head_dim=8, audio_cross_attention_dim=32, num_layers=1,
                 caption_channels=TEXT["tiny"]["hidden_size"], rope_type="split", rope_double_precision=False),
}

# the connectors map the stacked text encoder states (embedding + every layer) back to the encoder width
# (their heads x head_dim must equal it), which the transformer projects to each stream
CONNECTORS = {
    "tiny": dict(caption_channels=TEXT["tiny"]["hidden_size"], text_proj_in_factor=TEXT["tiny"]["num_hidden_layers"] + 1,
                 video_connector_num_attention_heads=4, video_connector_attention_head_dim=8,
                 video_connector_num_layers=1, video_connector_num_learnable_registers=None,
                 audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=8,
                 audio_connector_num_layers=1, audio_connector_num_learnable_registers=None,
                 connector_rope_base_seq_len=32, rope_double_precision=False, rope_type="split"),
}

# one spatio-temporal level (2x, 2x) after a 4x4 patchify: 8x spatial, 2x temporal
VAE = {
    "tiny": dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,),
                 decoder_block_out_channels=(8,), layers_per_block=(1,), decoder_layers_per_block=(1, 1),
                 spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
                 decoder_inject_noise=(False, False), downsample_type=("spatial",), upsample_residual=(False,),
                 upsample_factor=(1,), timestep_conditioning=False, patch_size=4, patch_size_t=1,
                 encoder_causal=True, decoder_causal=False),
}

# audio latents are packed as latent_channels x mel_bins / 4 = 2 x 2 = the transformer's audio_in_channels
AUDIO_VAE = {
    "tiny": dict(base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
                 resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
                 mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8),
}

VOCODER = {
    "tiny": dict(in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
                 resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1,
                 output_sampling_rate=16000),
}


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    from diffusers import LTX2VideoTransformer3DModel

    return build_module(lambda: LTX2VideoTransformer3DModel(**TRANSFORMER[size]), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler, LTX2Pipeline
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = gemma_tokenizer(1024)
    check_vocab(tokenizer, TEXT[size]["vocab_size"], "Gemma-3")
    config = Gemma3Config(text_config=dict(TEXT[size], model_type="gemma3_text"),
                          vision_config=dict(VISION[size], model_type="siglip_vision_model"), mm_tokens_per_image=4)
    vae = build_module(lambda: AutoencoderKLLTX2Video(**VAE[size]), seed=seed + 2, device=device, dtype=dtype)
    # decode all frames at once (the tiny VAE's frame-wise path would split 2 latent frames needlessly)
    vae.use_framewise_encoding = vae.use_framewise_decoding = False
    return LTX2Pipeline(
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
