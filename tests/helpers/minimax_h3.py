"""MiniMax-H3 text-to-video+audio (`MiniMaxH3ModularPipeline` from `MiniMaxH3Blocks`), tiny: a 2-block
packed-sequence transformer (4 heads x 16, one token-refiner block), the MiniMax-H3 video VAE (4x spatial,
4x temporal, a 1-layer transformer decoder), the MiniMax-H3 audio VAE (hop 4 at 160 Hz: its 40 latents a
second, as the real one), two MiniMax-H3 schedulers (video shift 12, audio shift 3) and a 51-layer Qwen3-VL
text encoder (the pipeline reads ``hidden_states[50]``; 32 wide, so still CPU milliseconds) behind the in-code
Qwen3-VL processor; random weights, CPU seconds.

diffusers 0.42.1 ships MiniMax-H3 as a modular pipeline only (no ``DiffusionPipeline``). Its denoise loop
runs ONE transformer call per step on a batch of 1 (the checkpoint is guidance-distilled: no CFG) over one
packed ``[text | keyframe rows | stereo audio rows | video rows]`` sequence; every video lasts 5-15 s at
24 fps (at least 124 frames), which at 16x24 pixels is 37 latent frames x 2x3 patches = 222 video rows,
414 audio rows (207 latents x 2 channels) and the prompt's text rows.

Not a registry model: the registry's models (CLI, server) are classic pipelines called with
``pipe(prompt, height=..., ...)`` that return ``.images`` / ``.frames``; a modular pipeline is called with
``pipe(prompt=..., output=["videos", "audio"])`` and returns a dict. Build it with
``build("tiny", dtype=..., device=..., seed=...)``; ``parallelize(pipe, ...)`` takes it as it takes any
pipeline (it patches ``pipe.transformer``, and ``pipe.transformer_ref`` for the ``ref2va`` workflow).
"""

from __future__ import annotations

import torch

from xstage_dit.families.build import build_module
from xstage_dit.families.nucleusmoe import VISION, qwen3vl_text_encoder

TEXT = {
    # MiniMax-H3 conditions on hidden_states[50]: the encoder needs more than 50 decoder layers
    "tiny": dict(vocab_size=2048, hidden_size=32, intermediate_size=32, num_hidden_layers=51, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
                 rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[2, 3, 3],
                                      mrope_interleaved=True)),
}

TRANSFORMER = {
    # rope_freq_dim 2: 2 * 3 * 2 = 12 of the 16 head channels rotate, the other 4 pass (as 96 of 128 in the real one)
    "tiny": dict(num_attention_heads=4, attention_head_dim=16, hidden_size=32, num_layers=2, num_refiner_layers=1,
                 ffn_dim=64, in_channels=4, audio_in_channels=4, patch_size=(1, 2, 2),
                 text_dim=TEXT["tiny"]["hidden_size"], freq_dim=16, time_embed_hidden_dim=32, time_embed_dim=16,
                 rope_freq_dim=2),
}

# clip_length 17 and 4x temporal: the real chunking (17 * n + 5 frames -> 5 * n + 2 latent frames)
VAE = {
    "tiny": dict(latent_channels=TRANSFORMER["tiny"]["in_channels"], block_out_channels=(8, 8, 8), layers_per_block=1,
                 spatial_downsample_factors=(2, 2, 1), temporal_downsample_factors=(1, 2, 2), norm_num_groups=4,
                 decoder_num_layers=1, decoder_num_attention_heads=2, decoder_attention_head_dim=8,
                 decoder_num_register_tokens=1, decoder_ffn_mult=2, latents_mean=(0.1, -0.2, 0.05, 0.3),
                 latents_std=(1.5, 0.9, 1.2, 1.1)),
}

# hop 2 * 2 = 4 samples a latent at 160 Hz: the pipeline's fixed 40 audio latents a second
AUDIO_VAE = {
    "tiny": dict(encoder_dim=4, encoder_rates=(2, 2), latent_dim=8, latent_channels=TRANSFORMER["tiny"]["audio_in_channels"],
                 num_attention_heads=2, decoder_dim=8, decoder_rates=(2, 2), decoder_kernel_sizes=(4, 4),
                 resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),), sampling_rate=160,
                 latents_mean=[0.0, 0.1, -0.1, 0.2], latents_std=[1.0, 1.2, 0.8, 1.1]),
}


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    from diffusers import MiniMaxH3Transformer3DModel

    return build_module(lambda: MiniMaxH3Transformer3DModel(**TRANSFORMER[size]), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    """The tiny `MiniMaxH3ModularPipeline` (t2va and fl2va workflows), every component on `device` in `dtype`.

    Example::

        pipe = build("tiny", dtype=torch.float32, device="cpu", seed=0)
        out = pipe(prompt="a red fox", height=16, width=24, num_frames=124, num_inference_steps=2,
                   generator=torch.Generator().manual_seed(0), output=["videos", "audio"], output_type="np")
        out["videos"].shape, out["audio"].shape   # (1, 124, 16, 24, 3), (1, 2, 828)
    """
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Blocks, MiniMaxH3Scheduler

    proc, text_encoder = qwen3vl_text_encoder(TEXT[size], VISION[size], seed=seed + 1, device=device, dtype=dtype)
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
        vae=build_module(lambda: AutoencoderKLMiniMaxH3(**VAE[size]), seed=seed + 2, device=device, dtype=dtype),
        audio_vae=build_module(lambda: AutoencoderKLMiniMaxH3Audio(**AUDIO_VAE[size]), seed=seed + 3, device=device,
                               dtype=dtype),
        text_encoder=text_encoder,
        tokenizer=proc.tokenizer,
        processor=proc,
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
    )
    return pipe
