"""Every built-in family: the tiny pipeline runs end to end on the CPU; the full size has the published
dimensions (checked on the meta device: no memory, no time)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xstage_dit.models import MODELS, load_pipeline, model_spec
from xstage_dit.models.generation import call_kwargs, to_pil_frames

TINY = [name for name, spec in MODELS.items() if spec.size == "tiny"]
PIPELINE_CLASSES = {
    "flux": "FluxPipeline",
    "wan": "WanPipeline",
    "hidream": "HiDreamImagePipeline",
    "nucleusmoe": "NucleusMoEImagePipeline",
}


def test_registry_covers_every_family_in_both_sizes():
    for family in PIPELINE_CLASSES:
        sizes = {s.size for s in MODELS.values() if s.family == family}
        assert sizes == {"tiny", "full"}, family


@pytest.mark.parametrize("name", [n for n in TINY if n != "tiny-flux"])  # tiny-flux: tests/test_models.py
def test_tiny_pipeline_runs_end_to_end(name):
    import diffusers

    spec = model_spec(name)
    pipe = load_pipeline(name, seed=0)
    assert type(pipe) is getattr(diffusers, PIPELINE_CLASSES[spec.family]) is getattr(diffusers, spec.pipeline_class)
    small = dict(height=64, width=64, frames=5) if spec.kind == "video" else {}
    out = pipe(**call_kwargs(pipe, spec, prompt="ein Fuchs im Schnee, 東京 🦊", steps=2, seed=1, **small))
    frames = to_pil_frames(out, spec.kind)  # raises on NaN/inf
    assert len(frames) == (5 if spec.kind == "video" else 1)
    pixels = np.stack([np.asarray(f) for f in frames])
    assert pixels.std() > 1.0  # not a constant image
    if spec.kind == "image":
        assert frames[0].size == (spec.width, spec.height)
    else:
        assert frames[0].size == (64, 64)


def test_hidream_keeps_its_pixel_area():
    """HiDream's pipeline rescales requests to a fixed area; the tiny model's area is its default size."""
    spec = model_spec("tiny-hidream")
    pipe = load_pipeline("tiny-hidream")
    out = pipe(**call_kwargs(pipe, spec, prompt="a fox", steps=1, height=64, width=256))
    assert to_pil_frames(out, "image")[0].size == (256, 64)


def test_wan_video_frame_rule():
    spec = model_spec("tiny-wan")
    spec.check_size(64, 64, 9)
    with pytest.raises(ValueError, match="got 8"):
        spec.check_size(64, 64, 8)


FULL_PARAMS = {  # published parameter counts of the denoising transformers
    "full-flux": (11.8e9, 12.0e9),  # FLUX.1-dev: 12B
    "full-wan": (14.0e9, 14.5e9),  # Wan2.1-T2V-14B
    "full-hidream": (16.9e9, 17.3e9),  # HiDream-I1-Full: 17B
    "full-nucleusmoe": (16.7e9, 17.2e9),  # Nucleus-Image: 17B total, ~2B active
}


@pytest.mark.parametrize("name", sorted(FULL_PARAMS))
def test_full_transformers_have_published_sizes(name):
    import importlib

    from xstage_dit.models.registry import FAMILY_MODULES

    spec = model_spec(name)
    family = importlib.import_module(FAMILY_MODULES[spec.family])
    model = family.build_transformer("full", dtype=torch.bfloat16, device="meta")
    lo, hi = FULL_PARAMS[name]
    assert lo < sum(p.numel() for p in model.parameters()) < hi


def test_full_moe_shapes_are_the_published_ones():
    from xstage_dit.models import hidream, nucleusmoe

    h = hidream.build_transformer("full", dtype=torch.bfloat16, device="meta")
    assert (h.config.num_routed_experts, h.config.num_activated_experts) == (4, 2)
    assert h.config.num_attention_heads * h.config.attention_head_dim == 2560
    assert len(h.config.llama_layers) == h.config.num_layers + h.config.num_single_layers
    n = nucleusmoe.build_transformer("full", dtype=torch.bfloat16, device="meta")
    assert (n.config.num_experts, n.config.moe_intermediate_dim, n.config.num_layers) == (64, 1344, 32)
    assert n.config.num_attention_heads * n.config.attention_head_dim == 2048


def test_build_module_rejects_empty_parameters():
    from xstage_dit.models.build import build_module

    with pytest.raises(ValueError, match="non-empty"):
        build_module(lambda: torch.nn.Linear(4, 0), seed=0, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="floating"):
        build_module(lambda: torch.nn.Linear(4, 4), seed=0, device="cpu", dtype=torch.int8)
