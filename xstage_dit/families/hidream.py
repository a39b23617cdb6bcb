"""HiDream-I1 text-to-image (`HiDreamImagePipeline`): tiny (CPU seconds) and full (HiDream-I1-Full dimensions).

Full size: sparse-MoE transformer, 16 double + 32 single blocks, 20 heads x 128 (2560 wide), 4 routed
experts with 2 active plus a shared expert, caption channels 4096 (T5-XXL) and 4096 (Llama-3.1-8B, one
hidden layer per block), pooled text embedding 2048 (CLIP-L 768 + CLIP-G 1280); FLUX VAE.

The record: our sequence plan (every text piece split after its projection, the image tokens after the patch
embedding; square latents only, so a non-square request at sp > 1 is refused before it is queued), expert
parallelism of its top-2 MoE, batched CFG (the pipeline runs one call on an (uncond, cond) batch).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from xstage_dit import _diffusers_private as private
from xstage_dit.families import flux, latent_decode, sharding
from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.experts import expert_seed, uniform_
from xstage_dit.families.record import ExpertFacts, FamilyRecord, SequenceParallelFacts, SizeLimits
from xstage_dit.families.sp_plan import PlanHook, SequenceParallelSpec
from xstage_dit.families.spec import ModelSpec
from xstage_dit.families.tokenizers import clip_tokenizer, llama_tokenizer, t5_tokenizer

# Llama hidden layer fed to each block: 32 layers, then the last one repeated (48 blocks in all).
FULL_LLAMA_LAYERS = list(range(32)) + [31] * 16

TRANSFORMER = {
    "full": dict(
        patch_size=2, in_channels=16, out_channels=16, num_layers=16, num_single_layers=32, attention_head_dim=128,
        num_attention_heads=20, caption_channels=[4096, 4096], text_emb_dim=2048, num_routed_experts=4,
        num_activated_experts=2, axes_dims_rope=(64, 32, 32), max_resolution=(128, 128),
        llama_layers=FULL_LLAMA_LAYERS,
    ),
    "tiny": dict(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, caption_channels=[32, 32], text_emb_dim=64, num_routed_experts=4,
        num_activated_experts=2, axes_dims_rope=(8, 4, 4), max_resolution=(32, 32), llama_layers=[0, 1],
    ),
}

# HiDream's CLIP encoders take 248 positions (long CLIP); the pipeline pads them to max_sequence_length.
CLIP_L = {
    "full": dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, max_position_embeddings=248, hidden_act="quick_gelu",
                 projection_dim=768, bos_token_id=0, eos_token_id=1, pad_token_id=1),
    "tiny": dict(flux.CLIP["tiny"], max_position_embeddings=248),
}
CLIP_G = {
    "full": dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                 num_attention_heads=20, max_position_embeddings=248, hidden_act="gelu",
                 projection_dim=1280, bos_token_id=0, eos_token_id=1, pad_token_id=1),
    "tiny": dict(flux.CLIP["tiny"], max_position_embeddings=248),
}
LLAMA = {
    "full": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                 rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=3),
    "tiny": dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=3),
}

TINY_SIDE_PX = 128

SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0, expert_shard=None):
    """The `HiDreamImageTransformer2DModel` alone (MoE feed-forward blocks included).

    Routed experts are drawn per (seed, layer, expert) (`xstage_dit.families.experts`); with
    ``expert_shard=(rank, world)`` only this rank's experts are made and the MoE layers are EP layers.
    """
    from diffusers import HiDreamImageTransformer2DModel

    from xstage_dit.families.experts import build_with_experts

    return build_with_experts(lambda: HiDreamImageTransformer2DModel(**TRANSFORMER[size]), "hidream", seed=seed,
                              shard=expert_shard, build_module=build_module, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int, expert_shard=None):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline
    from transformers import (CLIPTextConfig, CLIPTextModelWithProjection, LlamaConfig, LlamaForCausalLM,
                              T5Config, T5EncoderModel)

    tokenizer = clip_tokenizer(248)
    tokenizer_2 = clip_tokenizer(248)
    tokenizer_3 = t5_tokenizer(512)
    tokenizer_4 = llama_tokenizer(8192)
    check_vocab(tokenizer, CLIP_L[size]["vocab_size"], "CLIP-L")
    check_vocab(tokenizer_2, CLIP_G[size]["vocab_size"], "CLIP-G")
    check_vocab(tokenizer_3, flux.T5[size]["vocab_size"], "T5")
    check_vocab(tokenizer_4, LLAMA[size]["vocab_size"], "Llama")

    def llama():
        # Eager attention: the pipeline asks for attention weights (output_attentions=True).
        return LlamaForCausalLM(LlamaConfig(**LLAMA[size], attn_implementation="eager"))

    def kw(offset):
        return dict(seed=seed + offset, device=device, dtype=dtype)

    pipe = HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=build_module(lambda: AutoencoderKL(**flux.VAE[size]), **kw(5)),
        text_encoder=build_module(lambda: CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_L[size])), **kw(1)),
        tokenizer=tokenizer,
        text_encoder_2=build_module(lambda: CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_G[size])), **kw(2)),
        tokenizer_2=tokenizer_2,
        text_encoder_3=build_module(lambda: T5EncoderModel(T5Config(**flux.T5[size])), **kw(3)),
        tokenizer_3=tokenizer_3,
        text_encoder_4=build_module(llama, **kw(4)),
        tokenizer_4=tokenizer_4,
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed, expert_shard=expert_shard),
    )
    # HiDream rescales every request to the area (default_sample_size * 8)^2, keeping the aspect ratio
    # (1024^2 for the real model); the tiny model works at 128^2.
    pipe.default_sample_size = TINY_SIDE_PX // pipe.vae_scale_factor if size == "tiny" else 128
    return pipe


# ---- the record ---------------------------------------------------------------------------------------------

class _ImageSplit(PlanHook):
    """Splits x_embedder's output (image tokens) and remembers the full image length for the ids hook."""

    def post_forward(self, module, output):
        sharding.check_splittable(output.shape[1], self.state.world, "HiDream's image tokens")
        self.state.named["image"] = output.shape[1]
        self.state.record(output.shape[1])
        return sharding.shard(output, 1, self.state.rank, self.state.world)


class _IdsSplit(PlanHook):
    """pe_embedder gets ids = [full image ids, local text ids]: keep this rank's image ids only.

    Text ids are all zero in HiDream, so every text token has the same rotary embedding and the local
    text ids need no cutting (their count already equals the local text tokens).
    """

    def pre_forward(self, module, ids):
        total = self.state.named["image"]
        img = sharding.shard(ids[:, :total], 1, self.state.rank, self.state.world)
        return (torch.cat([img, ids[:, total:]], dim=1),), {}


class _MaskCheck(PlanHook):
    """Non-square latents come padded with ``hidden_states_masks``, which the split does not follow: refused
    (requests are checked before this: `SizeLimits.square_under_sp`)."""

    def pre_forward(self, module, *args, **kwargs):
        hidden_states = kwargs.get("hidden_states", args[0] if args else None)
        masks = kwargs.get("hidden_states_masks")
        non_square = (hidden_states is not None and hidden_states.ndim == 4
                      and hidden_states.shape[-1] != hidden_states.shape[-2])
        if masks is not None or non_square:
            raise NotImplementedError(
                "HiDream under sequence parallelism supports square latents (no hidden_states_masks); got latents "
                f"of shape {tuple(hidden_states.shape) if hidden_states is not None else None}"
            )
        return args, kwargs


def _sequence_plan(model: torch.nn.Module) -> SequenceParallelSpec:
    cpi, cpo = private.cp_types()
    if getattr(model, "caption_projection", None) is None:
        raise ValueError("expected a HiDream transformer with caption_projection layers, got caption_projection=None")
    return SequenceParallelSpec(
        cp_plan={
            # every text piece (T5 and each Llama layer) is split after its projection
            "caption_projection.*": {0: cpi(split_dim=1, expected_dims=3, split_output=True)},
            "final_layer": cpo(gather_dim=1, expected_dims=3),
        },
        # HiDream's processor calls SDPA itself: ours reproduces it with the xstage attention
        processor_swaps={"HiDreamAttnProcessor": "xstage_dit.features.processors:XStageHiDreamAttnProcessor.from_processor"},
        extra_hooks=[("x_embedder", _ImageSplit), ("pe_embedder", _IdsSplit), ("", lambda state: _MaskCheck())],
    )


def _random_experts(layer_name, lo, hi, seed, hidden, inter, device, dtype):
    """uniform(+-1/sqrt(fan_in)) per expert (nn.Linear's default bound), packed as the EP layer stores them."""
    gate_up, down = [], []
    for e in range(lo, hi):
        gen = torch.Generator(device).manual_seed(expert_seed(seed, layer_name, e))
        w1 = uniform_(gen, (inter, hidden), 1.0 / math.sqrt(hidden), device)
        w2 = uniform_(gen, (hidden, inter), 1.0 / math.sqrt(inter), device)
        w3 = uniform_(gen, (inter, hidden), 1.0 / math.sqrt(hidden), device)
        gate_up.append(torch.cat([w1.t(), w3.t()], dim=1).to(dtype))
        down.append(w2.t().to(dtype))
    return torch.stack(gate_up), torch.stack(down)


def _read_experts(reader, layer_name, lo, hi):
    gate_up, down = [], []
    for e in range(lo, hi):  # experts.{e}.w1/w2/w3: only this rank's e are read
        w1, w2, w3 = (reader.read(f"{layer_name}.experts.{e}.{w}.weight") for w in ("w1", "w2", "w3"))
        gate_up.append(torch.cat([w1.t(), w3.t()], dim=1))
        down.append(w2.t())
    return torch.stack(gate_up), torch.stack(down)


def _materialize(layer, gate_up, down):
    inter = down.shape[1]
    for e, m in enumerate(layer.experts):
        m.w1.weight = nn.Parameter(gate_up[e, :, :inter].t().contiguous(), requires_grad=False)
        m.w3.weight = nn.Parameter(gate_up[e, :, inter:].t().contiguous(), requires_grad=False)
        m.w2.weight = nn.Parameter(down[e].t().contiguous(), requires_grad=False)


EXPERTS = ExpertFacts(
    layer_class="MOEFeedForwardSwiGLU", ep_layer="xstage_dit.features.ep_layers:HiDreamMoEEPLayer",
    count_key="num_routed_experts", meta_experts=lambda: private.hidream_meta_experts(),
    num_experts=lambda layer: len(layer.experts),
    dims=lambda layer: (layer.experts[0].w1.in_features, layer.experts[0].w1.out_features),
    random_experts=_random_experts, read_experts=_read_experts, materialize=_materialize,
)

SPECS = (
    ModelSpec(
        name="tiny-hidream", family="hidream", size="tiny", kind="image", pipeline_class="HiDreamImagePipeline",
        patch_multiple=16, height=128, width=128, steps=4, guidance=5.0, max_sequence_length=32,
        description="HiDream-I1 architecture (MoE: 4 experts, top-2), 1+1 blocks, 2 heads x 16, random weights",
    ),
    ModelSpec(
        name="full-hidream", family="hidream", size="full", kind="image", pipeline_class="HiDreamImagePipeline",
        patch_multiple=16, height=1024, width=1024, steps=50, guidance=5.0, max_sequence_length=128,
        description="HiDream-I1-Full dimensions (17B MoE transformer: 16 double + 32 single blocks, 20 x 128), "
        "random weights",
    ),
)

RECORD = FamilyRecord(
    name="hidream", title="HiDream-I1", kind="image",
    pipelines={"HiDreamImagePipeline": "t2i"},
    transformers=("HiDreamImageTransformer2DModel",),
    sp=SequenceParallelFacts(
        plan_source="xstage", build=_sequence_plan, cfg="batched", cfg_needs_guidance=True,
        # encoder_hidden_states_llama3 is (layers, batch, seq, dim); the rest lead with batch
        cfg_batch_dims={"hidden_states": 0, "timesteps": 0, "encoder_hidden_states_t5": 0,
                        "encoder_hidden_states_llama3": 1, "pooled_embeds": 0, "img_ids": 0, "img_sizes": 0,
                        "hidden_states_masks": 0},
    ),
    experts=EXPERTS, limits=SizeLimits(patch_multiple=16, square_under_sp=True), specs=SPECS,
    latent_decode=latent_decode.scaled_shifted,
    build=build, build_transformer=build_transformer, transformer_dims=TRANSFORMER,
    real_weights_example="HiDream-I1-Full", pipeline_worlds=(2, 4),
)
