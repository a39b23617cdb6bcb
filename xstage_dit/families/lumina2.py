"""Lumina-Image 2.0 text-to-image (`Lumina2Pipeline`): tiny (CPU seconds) and full (Lumina-Image-2.0 dimensions).

Full size: a unified DiT of 26 joint blocks after 2 caption-refiner and 2 noise-refiner blocks, 24 query heads x 96
with 8 key/value heads (grouped-query), 3-axis rotary positions; the FLUX VAE (16 channels, 8x) with the pipeline's
2x2 patches (16-pixel size rule); a Gemma-2-2B text encoder read at its second-to-last layer; flow-matching Euler
(shift 6). Tiny: the same classes, 2 joint blocks + 1 refiner of each kind, 4 heads x 8 over 2 key/value heads, a
2-layer Gemma-2 over the in-code Gemma tokenizer, the tiny FLUX VAE.

Sequence parallel (our plan, Z-Image's shape): the refiners run on the whole caption and the whole image on every
rank (their attention stays local); the joint ``[caption, image]`` sequence they build is split where the first
joint block receives it, with its padding mask and rotary table (handed to every block), and gathered after the
output norm. The attention processor calls SDPA itself, so it is swapped for the same math through
``dispatch_attention_fn`` (the sequence-parallel backend; a padded batch's key mask goes with it). CFG is two
calls a step, cond then uncond ("paired"); the pipeline's CFG truncation (``cfg_trunc_ratio`` < 1, which drops
the uncond call in late steps) cannot run with cfg=2: the unpaired call is refused with a RuntimeError.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from xstage_dit.families.build import build_module
from xstage_dit.families.flux import VAE as FLUX_VAE
from xstage_dit.families import latent_decode
from xstage_dit.families.record import FamilyRecord, FeatureFacts, SequenceParallelFacts, SizeLimits
from xstage_dit.families.sana import gemma2_text_encoder
from xstage_dit.families.spec import ModelSpec

if TYPE_CHECKING:  # diffusers (through sp_plan) is imported when the plan is built, not with the record
    from xstage_dit.families.sp_plan import SequenceParallelSpec

TRANSFORMER = {
    # Lumina-Image-2.0/transformer/config.json
    "full": dict(sample_size=128, patch_size=2, in_channels=16, hidden_size=2304, num_layers=26, num_refiner_layers=2,
                 num_attention_heads=24, num_kv_heads=8, multiple_of=256, ffn_dim_multiplier=None, norm_eps=1e-5,
                 scaling_factor=1.0, axes_dim_rope=(32, 32, 32), axes_lens=(300, 512, 512), cap_feat_dim=2304),
    "tiny": dict(sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, num_refiner_layers=1,
                 num_attention_heads=4, num_kv_heads=2, multiple_of=16, ffn_dim_multiplier=None, norm_eps=1e-5,
                 scaling_factor=1.0, axes_dim_rope=(2, 2, 4), axes_lens=(300, 512, 512), cap_feat_dim=32),
}

VAE = {size: dict(FLUX_VAE[size], scaling_factor=0.3611, shift_factor=0.1159) for size in ("full", "tiny")}

SCHEDULER = dict(num_train_timesteps=1000, shift=6.0, use_dynamic_shifting=False)


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    """The `Lumina2Transformer2DModel` alone (what a denoising-step benchmark needs)."""
    from diffusers import Lumina2Transformer2DModel

    return build_module(lambda: Lumina2Transformer2DModel(**TRANSFORMER[size]), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, Lumina2Pipeline

    tokenizer, text_encoder = gemma2_text_encoder(size, seed=seed + 1, device=device, dtype=dtype)
    return Lumina2Pipeline(
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=build_module(lambda: AutoencoderKL(**VAE[size]), seed=seed + 2, device=device, dtype=dtype),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
    )


# ---- sequence parallel ---------------------------------------------------------------------------------------


class Lumina2DispatchingAttention:
    """``Lumina2AttnProcessor2_0``'s math (q/k RMS norms, complex rotary, grouped-query heads repeated, a boolean
    key mask) with its attention call through diffusers' ``dispatch_attention_fn`` instead of torch's SDPA, so the
    backend and ``_parallel_config`` the sequence-parallel feature sets on it take the call.

    hidden_states: (batch, seq_local, dim); attention_mask: (batch, seq_local) bool or None; image_rotary_emb:
    (batch, seq_local, head_dim / 2) complex. Returns (batch, seq_local, dim).
    """

    _attention_backend = None
    _parallel_config = None

    @classmethod
    def from_processor(cls, processor) -> "Lumina2DispatchingAttention":
        return cls()

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb: torch.Tensor | None = None,
                 base_sequence_length: int | None = None) -> torch.Tensor:
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.embeddings import apply_rotary_emb

        if base_sequence_length is not None and getattr(self._parallel_config, "world", 1) > 1:
            # its scale reads the sequence length, which is this rank's shard here
            raise NotImplementedError("Lumina-Image 2.0's proportional attention (base_sequence_length) under "
                                      "sequence parallelism is not supported, got "
                                      f"base_sequence_length={base_sequence_length}")
        batch_size, sequence_length, _ = hidden_states.shape
        query, key, value = attn.to_q(hidden_states), attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states)
        head_dim = query.shape[-1] // attn.heads
        kv_heads = key.shape[-1] // head_dim
        dtype = query.dtype
        query = query.view(batch_size, -1, attn.heads, head_dim)
        key = key.view(batch_size, -1, kv_heads, head_dim)
        value = value.view(batch_size, -1, kv_heads, head_dim)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, use_real=False)
            key = apply_rotary_emb(key, image_rotary_emb, use_real=False)
        query, key = query.to(dtype), key.to(dtype)
        scale = attn.scale
        if base_sequence_length is not None:
            scale = math.sqrt(math.log(sequence_length, base_sequence_length)) * attn.scale
        repeat = attn.heads // kv_heads
        if repeat >= 1:  # as the original: every query head gets its key/value head's copy
            key = key.unsqueeze(3).repeat(1, 1, 1, repeat, 1).flatten(2, 3)
            value = value.unsqueeze(3).repeat(1, 1, 1, repeat, 1).flatten(2, 3)
        if attention_mask is not None:
            attention_mask = attention_mask.bool().view(batch_size, 1, 1, -1)
        hidden_states = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, scale=scale,
                                              backend=self._attention_backend, parallel_config=self._parallel_config)
        hidden_states = hidden_states.reshape(batch_size, -1, attn.heads * head_dim).type_as(query)
        return attn.to_out[1](attn.to_out[0](hidden_states))


def lumina2_sp(model: torch.nn.Module) -> SequenceParallelSpec:
    """The plan of `Lumina2Transformer2DModel` (see the module docstring); ValueError naming what does not fit."""
    from xstage_dit import _diffusers_private as private
    from xstage_dit.families.sp_plan import SequenceParallelSpec

    cpi, cpo = private.cp_types()
    for name in ("layers", "context_refiner", "noise_refiner"):
        blocks = getattr(model, name, None)
        if not isinstance(blocks, torch.nn.ModuleList) or (len(blocks) == 0 and name == "layers"):
            raise ValueError(f"expected {type(model).__name__}.{name} to be a non-empty ModuleList, got "
                             f"{type(blocks).__name__}")
    return SequenceParallelSpec(
        cp_plan={
            # the joint [caption, image] sequence is built outside any module, right before the first block
            "layers.0": {"hidden_states": cpi(split_dim=1, expected_dims=3)},
            # its padding mask (batch, seq) (None when every sample has the same length) and rotary table
            # (batch, seq, head_dim / 2) go to every block
            "layers.*": {"attention_mask": cpi(split_dim=1, expected_dims=2),
                         "image_rotary_emb": cpi(split_dim=1, expected_dims=3)},
            "norm_out": cpo(gather_dim=1, expected_dims=3),
        },
        processor_swaps={"Lumina2AttnProcessor2_0": Lumina2DispatchingAttention.from_processor},
        # the refiners attend their own whole piece (caption or image), before the split
        local_attention=("context_refiner.*", "noise_refiner.*"),
    )


def _text_read_indices(pipe, arguments: dict) -> list[int]:
    """The Gemma hidden state the pipeline's encode_prompt reads: always the second-to-last
    (``Lumina2Pipeline._get_gemma_prompt_embeds``: ``hidden_states[-2]``)."""
    return [-2]


RECORD = FamilyRecord(
    name="lumina2",
    title="Lumina-Image 2.0",
    kind="image",
    pipelines={"Lumina2Pipeline": "t2i"},
    transformers=("Lumina2Transformer2DModel",),
    sp=SequenceParallelFacts(plan_source="xstage (refiners whole, joint sequence split)", build=lumina2_sp,
                             cfg="paired", cfg_needs_guidance=True),
    limits=SizeLimits(patch_multiple=16),
    facts=FeatureFacts(text_read_indices=_text_read_indices),
    specs=(
        ModelSpec(name="tiny-lumina2", family="lumina2", size="tiny", kind="image", pipeline_class="Lumina2Pipeline",
                  patch_multiple=16, height=64, width=64, steps=2, guidance=4.0, max_sequence_length=128,
                  description="Lumina-Image 2.0 architecture, 2 joint blocks + 1+1 refiners, 4 heads x 8 (2 kv heads), "
                  "Gemma-2 text encoder, random weights (CPU seconds)"),
        ModelSpec(name="full-lumina2", family="lumina2", size="full", kind="image", pipeline_class="Lumina2Pipeline",
                  patch_multiple=16, height=1024, width=1024, steps=50, guidance=4.0, max_sequence_length=256,
                  description="Lumina-Image-2.0 dimensions (2.6B transformer: 26 joint blocks + 2+2 refiners, "
                  "24 x 96, 8 kv heads), Gemma-2-2B, FLUX VAE, random weights"),
    ),
    latent_decode=latent_decode.scaled_shifted,
    build=build,
    build_transformer=build_transformer,
    transformer_dims=TRANSFORMER,
    real_weights_example="Lumina-Image-2.0",
    pipeline_worlds=(1, 2, 4),
)
