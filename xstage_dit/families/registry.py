"""The model registry: every built-in model name, its `ModelSpec` and the module that builds it.

Model facts live here, in one table, not in isinstance chains. A family module (``flux.py``...) exposes
``build(size, *, dtype, device, seed) -> DiffusionPipeline``.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from xstage_dit.families.hunyuan_video import PROMPT_TEMPLATE as HUNYUAN_VIDEO_TEMPLATE
from xstage_dit.families.record import FamilyRecord
from xstage_dit.families.spec import ModelSpec

# family -> module with build(size, ...)
FAMILY_MODULES = {
    "flux": "xstage_dit.families.flux",
    "wan": "xstage_dit.families.wan",
    "nucleusmoe": "xstage_dit.families.nucleusmoe",
    "hidream": "xstage_dit.families.hidream",
    "ltx": "xstage_dit.families.ltx",
    "cogvideox": "xstage_dit.families.cogvideox",
    "sd3": "xstage_dit.families.sd3",
    "z-image": "xstage_dit.families.z_image",
    "wan-vace": "xstage_dit.families.wan_vace",
    "skyreels-v2": "xstage_dit.families.skyreels",
    "qwenimage": "xstage_dit.families.qwenimage",
    "helios": "xstage_dit.families.helios",
    "flux2": "xstage_dit.families.flux2",
    "qwenimage21": "xstage_dit.families.qwenimage21",
    "ltx2": "xstage_dit.families.ltx2",
    "hunyuanvideo": "xstage_dit.families.hunyuan_video",
    "hunyuanvideo15": "xstage_dit.families.hunyuan_video15",
    "hunyuanimage": "xstage_dit.families.hunyuan_image",
}

# diffusers pipeline class (model_index.json "_class_name") -> family, for local folders.
PIPELINE_FAMILIES = {
    "FluxPipeline": "flux",
    "WanPipeline": "wan",
    "NucleusMoEImagePipeline": "nucleusmoe",
    "HiDreamImagePipeline": "hidream",
}


def _specs() -> dict[str, ModelSpec]:
    specs = [
        ModelSpec(
            name="tiny-flux", family="flux", size="tiny", kind="image", pipeline_class="FluxPipeline",
            patch_multiple=16, height=128, width=128, steps=4, guidance=3.5, max_sequence_length=64,
            description="FLUX.1 architecture, 1+1 blocks, 2 heads x 16, random weights (CPU seconds)",
        ),
        ModelSpec(
            name="full-flux", family="flux", size="full", kind="image", pipeline_class="FluxPipeline",
            patch_multiple=16, height=1024, width=1024, steps=28, guidance=3.5, max_sequence_length=512,
            description="FLUX.1-dev dimensions (12B transformer: 19 double + 38 single blocks, 24 x 128), random weights",
        ),
        ModelSpec(
            name="tiny-wan", family="wan", size="tiny", kind="video", pipeline_class="WanPipeline",
            patch_multiple=16, height=128, width=128, frames=9, frame_multiple=4, steps=4, guidance=5.0,
            max_sequence_length=32, fps=16,
            description="Wan 2.1 T2V architecture, 2 blocks, 2 heads x 16, random weights (CPU seconds)",
        ),
        ModelSpec(
            name="full-wan", family="wan", size="full", kind="video", pipeline_class="WanPipeline",
            patch_multiple=16, height=480, width=832, frames=81, frame_multiple=4, steps=50, guidance=5.0,
            max_sequence_length=512, fps=16,
            description="Wan2.1-T2V-14B dimensions (40 blocks, 40 heads x 128), 480p x 81 frames, random weights",
        ),
        ModelSpec(
            name="tiny-nucleusmoe", family="nucleusmoe", size="tiny", kind="image",
            pipeline_class="NucleusMoEImagePipeline", patch_multiple=16, height=128, width=128, steps=4,
            guidance=4.0, max_sequence_length=128,
            description="NucleusMoE-Image architecture (3 dense + 1 MoE block, 4 experts), 2 heads x 32, random weights",
        ),
        ModelSpec(
            name="full-nucleusmoe", family="nucleusmoe", size="full", kind="image",
            pipeline_class="NucleusMoEImagePipeline", patch_multiple=16, height=1024, width=1024, steps=50,
            guidance=4.0, max_sequence_length=1024,
            description="Nucleus-Image dimensions (17B MoE transformer: 32 blocks, 64 experts x 1344, 16 x 128), "
            "random weights",
        ),
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
        # Tiny pipelines of the other families parallelize supports (tests/features/test_families.py)
        ModelSpec(
            name="tiny-ltx", family="ltx", size="tiny", kind="video", pipeline_class="LTXPipeline",
            patch_multiple=32, height=64, width=96, frames=9, frame_multiple=8, steps=2, guidance=3.0,
            max_sequence_length=16, fps=24,
            description="LTX-Video architecture, 1 block, 4 heads x 8, LTX VAE (32x, 8x), random weights",
        ),
        ModelSpec(
            name="tiny-cogvideox", family="cogvideox", size="tiny", kind="video", pipeline_class="CogVideoXPipeline",
            patch_multiple=16, height=64, width=64, frames=9, frame_multiple=4, steps=2, guidance=6.0,
            max_sequence_length=16, fps=8,
            description="CogVideoX-5B style (rotary positions), 1 block, 4 heads x 16, random weights",
        ),
        ModelSpec(
            name="tiny-sd3", family="sd3", size="tiny", kind="image", pipeline_class="StableDiffusion3Pipeline",
            patch_multiple=16, height=64, width=64, steps=2, guidance=7.0, max_sequence_length=16,
            description="SD3.5 architecture (a dual-attention block, RMS q/k norm), 2 blocks, 4 heads x 8, random weights",
        ),
        ModelSpec(
            name="tiny-z-image", family="z-image", size="tiny", kind="image", pipeline_class="ZImagePipeline",
            patch_multiple=16, height=64, width=64, steps=2, guidance=0.0, max_sequence_length=32,
            description="Z-Image architecture, 1 layer + refiners, 6 heads x 8, Qwen3 text encoder, random weights",
        ),
        ModelSpec(
            name="tiny-wan-vace", family="wan-vace", size="tiny", kind="video", pipeline_class="WanVACEPipeline",
            patch_multiple=16, height=64, width=64, frames=5, frame_multiple=4, steps=2, guidance=1.0,
            max_sequence_length=16, fps=16,
            description="Wan-VACE architecture, 2 blocks with VACE hints, 4 heads x 16, random weights",
        ),
        ModelSpec(
            name="tiny-skyreels-v2", family="skyreels-v2", size="tiny", kind="video",
            pipeline_class="SkyReelsV2DiffusionForcingPipeline", patch_multiple=16, height=64, width=64, frames=5,
            frame_multiple=4, steps=2, guidance=1.0, max_sequence_length=16, fps=24,
            description="SkyReels-V2 diffusion forcing, 2 blocks, 4 heads x 16, random weights",
        ),
        ModelSpec(
            name="tiny-qwenimage", family="qwenimage", size="tiny", kind="image", pipeline_class="QwenImagePipeline",
            patch_multiple=16, height=64, width=64, steps=2, guidance=1.0, max_sequence_length=64,
            description="Qwen-Image architecture, 1 block, 4 heads x 16, Qwen2.5-VL text encoder, random weights",
        ),
        ModelSpec(
            name="tiny-qwenimage21", family="qwenimage21", size="tiny", kind="image",
            pipeline_class="QwenImage21Pipeline", patch_multiple=32, height=64, width=64, steps=2, guidance=1.0,
            description="Qwen-Image 2.1 architecture (block-causal, KV cache), 2 blocks, 4 heads x 16, Qwen3-VL text "
            "encoder, random weights",
        ),
        ModelSpec(
            name="tiny-ltx2", family="ltx2", size="tiny", kind="video", pipeline_class="LTX2Pipeline",
            patch_multiple=32, height=32, width=32, frames=5, frame_multiple=2, steps=2, guidance=3.0,
            max_sequence_length=16, fps=24,
            call_kwargs={"spatio_temporal_guidance_blocks": [0]},  # the tiny model's one block (LTX-2: 28)
            description="LTX-2 audio+video architecture, 1 block, 4 heads x 8 per stream, Gemma-3 text encoder, "
            "LTX-2 video/audio VAEs and vocoder, random weights (the audio is not written)",
        ),
        ModelSpec(
            name="tiny-hunyuanvideo", family="hunyuanvideo", size="tiny", kind="video",
            pipeline_class="HunyuanVideoPipeline", patch_multiple=16, height=32, width=32, frames=5, frame_multiple=4,
            steps=2, guidance=6.0, max_sequence_length=16, fps=24,
            call_kwargs={"prompt_template": HUNYUAN_VIDEO_TEMPLATE},  # its crop_start counts the in-code tokenizer
            description="HunyuanVideo architecture, 1+1 blocks, 4 heads x 16, Llama + CLIP text encoders, random weights",
        ),
        ModelSpec(
            name="tiny-hunyuanvideo15", family="hunyuanvideo15", size="tiny", kind="video",
            pipeline_class="HunyuanVideo15Pipeline", patch_multiple=4, height=32, width=32, frames=5, frame_multiple=4,
            steps=2, guidance=1.0, fps=24,  # CFG is its guider's (scale 6), not a call argument
            description="HunyuanVideo 1.5 architecture, 2 blocks, 4 heads x 16, Qwen2.5-VL + ByT5 text encoders, "
            "random weights",
        ),
        ModelSpec(
            name="tiny-hunyuanimage", family="hunyuanimage", size="tiny", kind="image", pipeline_class="HunyuanImagePipeline",
            patch_multiple=8, height=64, width=64, steps=2, guidance=1.0,  # guidance: its APG guiders (scale 3.5)
            description="HunyuanImage 2.1 architecture, 1+1 blocks, 4 heads x 16, Qwen2.5-VL + ByT5 text encoders, "
            "random weights",
        ),
        ModelSpec(
            name="tiny-flux2", family="flux2", size="tiny", kind="image", pipeline_class="Flux2Pipeline",
            patch_multiple=16, height=64, width=64, steps=2, guidance=4.0, max_sequence_length=32,
            call_kwargs={"text_encoder_out_layers": (1, 2, 3)},  # the tiny encoder's layers (FLUX.2: 10, 20, 30)
            description="FLUX.2 architecture, 1+1 blocks, 4 heads x 16, Mistral-3 text encoder, random weights",
        ),
        ModelSpec(
            name="tiny-helios", family="helios", size="tiny", kind="video", pipeline_class="HeliosPipeline",
            patch_multiple=16, height=64, width=64, frames=9, frame_multiple=4, steps=2, guidance=5.0,
            max_sequence_length=16, fps=24,
            description="Helios architecture, 3 blocks, 4 heads x 16, random weights",
        ),
    ]
    return {s.name: s for s in specs}


MODELS: dict[str, ModelSpec] = _specs()


# ---- family records (one file per family: families/<family>.py with RECORD = FamilyRecord(...)) -----------------


@functools.cache
def records() -> dict[str, FamilyRecord]:
    """Every family record of this package, by family name: each module of `xstage_dit.families` that defines
    ``RECORD`` (found, not listed, so a new family is one new file)."""
    import xstage_dit.families as package

    found: dict[str, FamilyRecord] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        record = getattr(module, "RECORD", None)
        if not isinstance(record, FamilyRecord):
            continue
        if record.name in found:
            raise ValueError(f"expected one record per family, got two named {record.name!r}")
        found[record.name] = record
    return found


def record(family: str) -> FamilyRecord:
    """The record of `family`; ValueError naming the known families otherwise."""
    known = records()
    if family not in known:
        raise ValueError(f"expected a family in {sorted(known)}, got {family!r}")
    return known[family]


def record_for_pipeline(class_name: str) -> FamilyRecord | None:
    """The record whose pipelines include the diffusers pipeline class `class_name` (model_index.json's
    ``_class_name``), or None."""
    return next((r for r in records().values() if class_name in r.pipelines), None)


def record_for_transformer(model) -> FamilyRecord | None:
    """The record of `model`'s transformer class or of its nearest diffusers base class (a user's subclass
    resolves to its family); None if no record names one. `model`: a module or a class."""
    cls = model if isinstance(model, type) else type(model)
    by_class = {name: r for r in records().values() for name in r.transformers}
    for base in cls.__mro__:
        found = by_class.get(base.__name__)
        if found is not None and base.__module__.startswith("diffusers."):
            return found
    return None


def _merge_records() -> None:
    """The records' built-in models, pipelines and builders join the tables above (the bridge until every family
    is a record)."""
    for r in records().values():
        for spec in r.specs:
            MODELS[spec.name] = spec
        for pipeline in r.pipelines:
            PIPELINE_FAMILIES.setdefault(pipeline, r.name)
        FAMILY_MODULES.setdefault(r.name, r.build.__module__ if r.build is not None else "")


_merge_records()
