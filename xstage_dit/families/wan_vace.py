"""Wan-VACE (`WanVACEPipeline`: text-to-video with a control video / reference images): tiny (2 Wan blocks, VACE
hints at both, 4 heads, the tiny Wan VAE and UMT5; random weights, CPU seconds) and full (Wan2.1-VACE-14B
dimensions, diffusers' class defaults: the Wan 14B transformer with VACE hints at every 5th of its 40 blocks).

The record: our plan (Wan's, plus the control branch whose hints are added block by block: every VACE block is
handed the whole video tokens), no CFG parallel.
"""

from __future__ import annotations

import torch

from xstage_dit import _diffusers_private as private
from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.record import FamilyRecord, FeatureFacts, SequenceParallelFacts, SizeLimits
from xstage_dit.families.sp_plan import SequenceParallelSpec, blocks_of, rope_split
from xstage_dit.families.spec import ModelSpec
from xstage_dit.families.tokenizers import t5_tokenizer
from xstage_dit.families.wan import TRANSFORMER as WAN, UMT5, VAE, WAN_VAE

# VACE's control input: the VAE latents of the control video and of its mask, plus the packed mask (z_dim * 2 + 8 * 8)
# 4 heads (the tiny Wan has 2) so that sp=4 can split them
TRANSFORMER = {"full": dict(WAN["full"], vace_layers=list(range(0, 40, 5)), vace_in_channels=VAE["full"]["z_dim"] * 2 + 64),
               "tiny": dict(WAN["tiny"], num_attention_heads=4, vace_layers=[0, 1],
                            vace_in_channels=VAE["tiny"]["z_dim"] * 2 + 64)}


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    from diffusers import WanVACETransformer3DModel

    return build_module(lambda: WanVACETransformer3DModel(**TRANSFORMER[size]), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanVACEPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = t5_tokenizer(512)
    check_vocab(tokenizer, UMT5[size]["vocab_size"], "UMT5")
    return WanVACEPipeline(
        tokenizer=tokenizer,
        text_encoder=build_module(lambda: UMT5EncoderModel(UMT5Config(**UMT5[size])), seed=seed + 1, device=device,
                                  dtype=dtype),
        vae=build_module(lambda: AutoencoderKLWan(**VAE[size]), seed=seed + 2, device=device, dtype=torch.float32),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
    )


# ---- the record ---------------------------------------------------------------------------------------------

def _sequence_plan(model: torch.nn.Module) -> SequenceParallelSpec:
    cpi, cpo = private.cp_types()
    blocks_of(model, "vace_blocks")
    rope = rope_split(cpi, 1, 4)
    return SequenceParallelSpec(
        cp_plan={
            "": {"timestep": cpi(split_dim=1, expected_dims=2)},  # per-token timesteps (Wan 2.2 TI2V style)
            "rope": rope,
            "vace_blocks.0": {"control_hidden_states": cpi(split_dim=1, expected_dims=3)},
            # every VACE block is handed the whole video tokens (the first adds them to the control tokens)
            "vace_blocks.*": {"hidden_states": cpi(split_dim=1, expected_dims=3)},
            "blocks.0": {"hidden_states": cpi(split_dim=1, expected_dims=3)},
            "proj_out": cpo(gather_dim=1, expected_dims=3),
        },
        kv_layouts={"blocks.*.attn2": "replicated", "vace_blocks.*.attn2": "replicated"},
    )


SPECS = (
    ModelSpec(
        name="tiny-wan-vace", family="wan-vace", size="tiny", kind="video", pipeline_class="WanVACEPipeline",
        patch_multiple=16, height=64, width=64, frames=5, frame_multiple=4, steps=2, guidance=1.0,
        max_sequence_length=16, fps=16,
        description="Wan-VACE architecture, 2 blocks with VACE hints, 4 heads x 16, random weights",
    ),
    ModelSpec(
        name="full-wan-vace", family="wan-vace", size="full", kind="video", pipeline_class="WanVACEPipeline",
        patch_multiple=16, height=480, width=832, frames=81, frame_multiple=4, steps=50, guidance=5.0,
        max_sequence_length=512, fps=16,
        description="Wan2.1-VACE-14B dimensions (40 blocks, VACE hints at 8, 40 heads x 128), random weights",
    ),
)

RECORD = FamilyRecord(
    name="wan-vace", title="Wan-VACE", kind="video",
    pipelines={"WanVACEPipeline": "t2v"},
    transformers=("WanVACETransformer3DModel",),
    sp=SequenceParallelFacts(plan_source="xstage", build=_sequence_plan, cfg=None),
    limits=SizeLimits(patch_multiple=16, frame_multiple=4), facts=FeatureFacts(video_vae=WAN_VAE), specs=SPECS,
    build=build, build_transformer=build_transformer, transformer_dims=TRANSFORMER,
    real_weights_example="Wan2.1-VACE-14B-diffusers", pipeline_worlds=(2, 4),
)
