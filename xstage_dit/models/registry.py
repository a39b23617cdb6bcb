"""The model registry: every built-in model name, its `ModelSpec` and the module that builds it.

Model facts live here, in one table, not in isinstance chains. A family module (``flux.py``...) exposes
``build(size, *, dtype, device, seed) -> DiffusionPipeline``.
"""

from __future__ import annotations

from xstage_dit.models.spec import ModelSpec

# family -> module with build(size, ...)
FAMILY_MODULES = {
    "flux": "xstage_dit.models.flux",
    "wan": "xstage_dit.models.wan",
    "nucleusmoe": "xstage_dit.models.nucleusmoe",
    "hidream": "xstage_dit.models.hidream",
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
    ]
    return {s.name: s for s in specs}


MODELS: dict[str, ModelSpec] = _specs()
