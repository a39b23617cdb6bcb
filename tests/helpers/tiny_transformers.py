"""Tiny transformers built directly (no pipeline) for the multi-rank workers: random weights, fp32, CPU."""

from __future__ import annotations

import torch


def hunyuan_video_transformer() -> torch.nn.Module:
    """A one-double-block, one-single-block HunyuanVideo transformer: 4 heads x 16, 32-wide text, seed 1."""
    from diffusers import HunyuanVideoTransformer3DModel

    from xstage_dit.families.build import build_module

    return build_module(lambda: HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=1, num_single_layers=1,
        num_refiner_layers=1, text_embed_dim=32, pooled_projection_dim=32, rope_axes_dim=(4, 6, 6),
    ), seed=1, device="cpu", dtype=torch.float32)
