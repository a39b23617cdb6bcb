"""HunyuanVideo text-to-video (`HunyuanVideoPipeline`): tiny (1 dual + 1 single block, 4 heads x 16, a 3-layer
Llama text encoder (the pipeline reads the hidden state 3rd from the end) over the in-code Llama tokenizer, a
CLIP text encoder for the pooled prompt, the HunyuanVideo VAE with 3 levels: 4x spatial, 4x temporal; random
weights, CPU seconds) and full (HunyuanVideo dimensions, diffusers' class defaults: the 13B transformer, 20 dual
+ 40 single blocks, 24 heads x 128; llava-llama-3-8b's language model and CLIP-L; the HunyuanVideo VAE).

The pipeline wraps the prompt in a chat template and drops its first ``crop_start`` tokens: the real
template's 95 are for the real tokenizer, so `PROMPT_TEMPLATE` carries the count for the in-code one
(the registry passes it as ``prompt_template``). It pads the prompt and passes its mask; guidance is embedded
(one call per step), true CFG with a negative prompt is a second call. The record: our plan (image and text split
after their embedders; the token refiner attends the whole prompt before the split; blocks get the text mask
rebuilt from the shards), paired CFG.
"""

from __future__ import annotations

import torch

from xstage_dit import _diffusers_private as private
from xstage_dit.families import sharding
from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.flux import CLIP
from xstage_dit.families.record import FamilyRecord, SequenceParallelFacts, SizeLimits
from xstage_dit.families.sp_plan import PlanHook, SequenceParallelSpec
from xstage_dit.families.spec import ModelSpec
from xstage_dit.families.tokenizers import clip_tokenizer, llama_tokenizer

TEXT = {
    # llava-llama-3-8b's language model
    "full": dict(vocab_size=128320, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5),
    "tiny": dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                     num_key_value_heads=1, max_position_embeddings=1024)}

TRANSFORMER = {
    "full": dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
                 num_single_layers=40, num_refiner_layers=2, text_embed_dim=TEXT["full"]["hidden_size"],
                 pooled_projection_dim=CLIP["full"]["hidden_size"], rope_axes_dim=(16, 56, 56)),
    "tiny": dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=1,
                 num_single_layers=1, num_refiner_layers=1, text_embed_dim=TEXT["tiny"]["hidden_size"],
                 pooled_projection_dim=CLIP["tiny"]["hidden_size"], rope_axes_dim=(4, 6, 6)),
}

VAE = {"full": dict(),  # the class defaults: HunyuanVideo's VAE (16 latent channels, 8x spatial, 4x temporal)
       "tiny": dict(latent_channels=4, block_out_channels=(8, 8, 8), layers_per_block=1, norm_num_groups=4,
                    down_block_types=("HunyuanVideoDownBlock3D",) * 3, up_block_types=("HunyuanVideoUpBlock3D",) * 3,
                    spatial_compression_ratio=4, temporal_compression_ratio=4, mid_block_add_attention=False)}

# A shorter system prompt than the real template's; crop_start = bos + the tokens before "{}" under the in-code
# Llama tokenizer (tests/families/test_models_families.py recounts it)
PROMPT_TEMPLATE = {
    "template": "<|start_header_id|>system<|end_header_id|>\n\nDescribe the video.<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>",
    "crop_start": 83,
}


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    from diffusers import HunyuanVideoTransformer3DModel

    return build_module(lambda: HunyuanVideoTransformer3DModel(**TRANSFORMER[size]), seed=seed, device=device,
                        dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    tokenizer, tokenizer_2 = llama_tokenizer(1024), clip_tokenizer()
    check_vocab(tokenizer, TEXT[size]["vocab_size"], "Llama")
    check_vocab(tokenizer_2, CLIP[size]["vocab_size"], "CLIP")
    return HunyuanVideoPipeline(
        text_encoder=build_module(lambda: LlamaModel(LlamaConfig(**TEXT[size])), seed=seed + 1, device=device,
                                  dtype=dtype),
        tokenizer=tokenizer,
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
        vae=build_module(lambda: AutoencoderKLHunyuanVideo(**VAE[size]), seed=seed + 2, device=device, dtype=dtype),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=build_module(lambda: CLIPTextModel(CLIPTextConfig(**CLIP[size])), seed=seed + 3, device=device,
                                    dtype=dtype),
        tokenizer_2=tokenizer_2,
    )


# ---- the record ---------------------------------------------------------------------------------------------

class _MaskRoot(PlanHook):
    """Records the text padding mask at entry; None when every text token is real (one check per forward)."""

    def pre_forward(self, module, *args, **kwargs):
        mask = kwargs.get("encoder_attention_mask", args[3] if len(args) > 3 else None)
        self.state.named["text_mask"] = None if mask is None or bool(mask.bool().all()) else mask.bool()
        return args, kwargs


class _BlockMask(PlanHook):
    """Blocks get a mask built from local lengths; replace it by [image shard ones, text mask shard]."""

    def pre_forward(self, module, hidden_states, encoder_hidden_states, temb, attention_mask=None, *rest, **kwargs):
        text_mask = self.state.named.get("text_mask")
        if text_mask is None:
            attention_mask = None
        else:
            local_text = sharding.shard(text_mask, 1, self.state.rank, self.state.world)
            ones = torch.ones(hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
            attention_mask = torch.cat([ones, local_text], dim=1)[:, None, None, :]
        return (hidden_states, encoder_hidden_states, temb, attention_mask, *rest), kwargs


def _sequence_plan(model: torch.nn.Module) -> SequenceParallelSpec:
    cpi, cpo = private.cp_types()
    return SequenceParallelSpec(
        cp_plan={
            "x_embedder": {0: cpi(split_dim=1, expected_dims=3, split_output=True)},
            "context_embedder": {0: cpi(split_dim=1, expected_dims=3, split_output=True)},
            "rope": {
                0: cpi(split_dim=0, expected_dims=2, split_output=True),
                1: cpi(split_dim=0, expected_dims=2, split_output=True),
            },
            "proj_out": cpo(gather_dim=1, expected_dims=3),
        },
        # the token refiner attends the whole text inside context_embedder, before the split
        local_attention=("context_embedder.*",),
        extra_hooks=[
            ("transformer_blocks.*", _BlockMask),
            ("single_transformer_blocks.*", _BlockMask),
            ("", _MaskRoot),
        ],
    )


SPECS = (
    ModelSpec(
        name="tiny-hunyuanvideo", family="hunyuanvideo", size="tiny", kind="video",
        pipeline_class="HunyuanVideoPipeline", patch_multiple=16, height=32, width=32, frames=5, frame_multiple=4,
        steps=2, guidance=6.0, max_sequence_length=16, fps=24,
        call_kwargs={"prompt_template": PROMPT_TEMPLATE},  # its crop_start counts the in-code tokenizer
        description="HunyuanVideo architecture, 1+1 blocks, 4 heads x 16, Llama + CLIP text encoders, random weights",
    ),
    ModelSpec(
        name="full-hunyuanvideo", family="hunyuanvideo", size="full", kind="video",
        pipeline_class="HunyuanVideoPipeline", patch_multiple=16, height=720, width=1280, frames=129, frame_multiple=4,
        steps=50, guidance=6.0, max_sequence_length=256, fps=24,
        description="HunyuanVideo dimensions (13B transformer: 20 + 40 blocks, 24 heads x 128), random weights",
    ),
)

RECORD = FamilyRecord(
    name="hunyuanvideo", title="HunyuanVideo", kind="video",
    pipelines={"HunyuanVideoPipeline": "t2v"},
    transformers=("HunyuanVideoTransformer3DModel",),
    sp=SequenceParallelFacts(plan_source="xstage", build=_sequence_plan),
    limits=SizeLimits(patch_multiple=16, frame_multiple=4), specs=SPECS,
    build=build, build_transformer=build_transformer, transformer_dims=TRANSFORMER,
    real_weights_example="HunyuanVideo", pipeline_worlds=(2, 4),
)
