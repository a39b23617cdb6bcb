"""ChronoEdit image editing as video (`ChronoEditPipeline`): Wan 2.1 I2V-style blocks with the image
cross-attention of CLIP vision embeddings. `parallelize` takes it from Python (diffusers' own sequence plan,
paired CFG); `generate` and `serve` do not run it (an "edit" pipeline of a video family: it makes frames of which
the edited image is one). No built-in model here: the CPU tests build a tiny one (``tests/helpers/chronoedit.py``).
"""

from __future__ import annotations

from xstage_dit.families.record import FamilyRecord, FeatureFacts, ImageInputFacts, SequenceParallelFacts
from xstage_dit.families.sp_plan import shipped_plan
from xstage_dit.families.wan import CROSS_ATTENTION_KV, WAN_VAE

RECORD = FamilyRecord(
    name="chronoedit", title="ChronoEdit", kind="video",
    pipelines={"ChronoEditPipeline": "edit"},
    transformers=("ChronoEditTransformer3DModel",),
    sp=SequenceParallelFacts(plan_source="diffusers", build=shipped_plan(CROSS_ATTENTION_KV), cfg_needs_guidance=True),
    facts=FeatureFacts(video_vae=WAN_VAE),
    real_weights_example="ChronoEdit-14B-Diffusers", pipeline_worlds=(2, 4),
    # its image is repeated for every prompt inside (CLIP embeddings and the first-frame latent)
    image_inputs={"ChronoEditPipeline": ImageInputFacts()},
)
