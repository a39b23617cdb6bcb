"""Helios text-to-video (`HeliosPipeline`): tiny (3 blocks: diffusers' own plan names exactly 40, ours follows
the model; 4 heads x 16, the tiny Wan VAE and UMT5; random weights, CPU seconds) and full (Helios-Base
dimensions, diffusers' class defaults: 40 blocks, 40 heads x 128; UMT5-XXL; the Wan VAE).

The record: diffusers' plan with its block count taken from the model, paired CFG (on when guidance_scale > 1).
"""

from __future__ import annotations

import torch

from xstage_dit import _diffusers_private as private
from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.record import FamilyRecord, FeatureFacts, SequenceParallelFacts, SizeLimits
from xstage_dit.families.sp_plan import SequenceParallelSpec, blocks_of
from xstage_dit.families.spec import ModelSpec
from xstage_dit.families.tokenizers import t5_tokenizer
from xstage_dit.families.wan import UMT5, VAE, WAN_VAE

TRANSFORMER = {
    "full": dict(num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
                 freq_dim=256, ffn_dim=13824, num_layers=40, rope_dim=(44, 42, 42)),
    "tiny": dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32,
                 freq_dim=32, ffn_dim=64, num_layers=3, rope_dim=(4, 6, 6)),
}


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    from diffusers import HeliosTransformer3DModel

    return build_module(lambda: HeliosTransformer3DModel(**TRANSFORMER[size]), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    from diffusers import AutoencoderKLWan, HeliosPipeline, HeliosScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = t5_tokenizer(512)
    check_vocab(tokenizer, UMT5[size]["vocab_size"], "UMT5")
    return HeliosPipeline(
        tokenizer=tokenizer,
        text_encoder=build_module(lambda: UMT5EncoderModel(UMT5Config(**UMT5[size])), seed=seed + 1, device=device,
                                  dtype=dtype),
        vae=build_module(lambda: AutoencoderKLWan(**VAE[size]), seed=seed + 2, device=device, dtype=torch.float32),
        scheduler=HeliosScheduler(stages=1, stage_range=[0, 1]),  # the plain (not pyramid) sampler
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
    )


# ---- the record ---------------------------------------------------------------------------------------------

def _sequence_plan(model: torch.nn.Module) -> SequenceParallelSpec:
    """diffusers' plan names blocks.0 .. blocks.39; ours follows len(model.blocks)."""
    cpi, cpo = private.cp_types()
    shipped = private.shipped_cp_plan(type(model)) or {}
    plan = {k: v for k, v in shipped.items() if "*" in k}  # the split entries (wildcards)
    if set(plan) != {"blocks.*.attn1", "blocks.*.attn2", "blocks.*.ffn"}:
        raise ValueError(f"expected Helios' _cp_plan to split blocks.*.attn1/attn2/ffn, got {sorted(plan)}")
    for i in range(blocks_of(model, "blocks")):
        for part in ("attn1", "attn2", "ffn"):
            plan[f"blocks.{i}.{part}"] = cpo(gather_dim=1, expected_dims=3)
    # Each attention sees the whole sequence again after its own gather, so its keys are local.
    return SequenceParallelSpec(cp_plan=plan, kv_layouts={"blocks.*.attn2": "replicated"})


SPECS = (
    ModelSpec(
        name="tiny-helios", family="helios", size="tiny", kind="video", pipeline_class="HeliosPipeline",
        patch_multiple=16, height=64, width=64, frames=9, frame_multiple=4, steps=2, guidance=5.0,
        max_sequence_length=16, fps=24,
        description="Helios architecture, 3 blocks, 4 heads x 16, random weights",
    ),
    ModelSpec(
        name="full-helios", family="helios", size="full", kind="video", pipeline_class="HeliosPipeline",
        patch_multiple=16, height=384, width=640, frames=129, frame_multiple=4, steps=50, guidance=5.0,
        max_sequence_length=512, fps=24,
        description="Helios-Base dimensions (40 blocks, 40 heads x 128), random weights",
    ),
)

RECORD = FamilyRecord(
    name="helios", title="Helios", kind="video",
    pipelines={"HeliosPipeline": "t2v"},
    transformers=("HeliosTransformer3DModel",),
    sp=SequenceParallelFacts(plan_source="diffusers (blocks from the model)", build=_sequence_plan,
                             cfg_needs_guidance=True),
    limits=SizeLimits(patch_multiple=16, frame_multiple=4), facts=FeatureFacts(video_vae=WAN_VAE), specs=SPECS,
    build=build, build_transformer=build_transformer, transformer_dims=TRANSFORMER,
    real_weights_example="Helios-Base", pipeline_worlds=(2, 4),
)
