"""`FamilyRecord`: everything the package knows about one model family, in one value.

One file per family (``xstage_dit/families/<family>.py``) defines ``RECORD = FamilyRecord(...)``; the registry
(`xstage_dit.families.registry`) finds every such module of this package, so adding a family is that one file
plus its test. Features, the engine, the server and the benchmark read model facts from the record that
`registry.record_for_transformer` / `record_for_pipeline` return, never from class-name tables of their own.

Example (a sketch of ``families/flux.py``)::

    RECORD = FamilyRecord(
        name="flux", title="FLUX.1", kind="image",
        pipelines={"FluxPipeline": "t2i"},
        transformers=("FluxTransformer2DModel",),
        sp=SequenceParallelFacts(plan_source="diffusers", build=shipped_plan(), check=_check_flux),
        limits=SizeLimits(patch_multiple=16),
        specs=(ModelSpec(name="tiny-flux", ...), ModelSpec(name="full-flux", ...)),
        build=build, build_transformer=build_transformer,
        real_weights_example="FLUX.1-dev",
    )
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

TASKS = ("t2i", "t2v", "i2v", "edit", "i2i", "inpaint")
CFG_STYLES = ("paired", "batched", None)


@dataclass(frozen=True)
class SequenceParallelFacts:
    """How `parallelize` shards this family's transformer over the sp ranks.

    plan_source: "diffusers" (its shipped ``_cp_plan``) or a short phrase naming our plan ("xstage", ...).
    build: transformer -> ``SequenceParallelSpec`` (the plan, the K/V layouts, processor swaps, extra hooks).
    check: (transformer, ParallelConfig) -> None, raising ValueError naming a rule of the model (or None).
    moe_layers: (diffusers MoE class name, "module:EP layer class") pairs swapped under expert parallelism.
    cfg: "paired" (two transformer calls a step, cond then uncond), "batched" (one call on an (uncond, cond)
        batch) or None (no CFG parallel).
    cfg_batch_dims: batched CFG only: input name -> its batch dim.
    """

    plan_source: str
    build: Callable[[Any], Any]
    check: Callable[[Any, Any], None] | None = None
    moe_layers: tuple[tuple[str, str], ...] = ()
    cfg: str | None = "paired"
    cfg_batch_dims: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cfg not in CFG_STYLES:
            raise ValueError(f"expected cfg in {CFG_STYLES}, got {self.cfg!r}")


@dataclass(frozen=True)
class SizeLimits:
    """What sizes a request may ask for (checked before a request is queued: a 4xx naming the field).

    patch_multiple: height and width must be multiples of this (VAE factor x patch size).
    frame_multiple: video: (frames - 1) must be a multiple of this.
    square_under_sp: the transformer takes only square latents at sp > 1 (HiDream).
    """

    patch_multiple: int = 16
    frame_multiple: int = 1
    square_under_sp: bool = False


@dataclass(frozen=True)
class FeatureFacts:
    """The per-family facts the features read (each None / empty where the feature does not apply).

    cfg_batch_guidance: pipeline -> whether its current call runs CFG (CFG batching arms on it).
    cfg_batch_text_inputs: (text input, its padding mask) CFG batching pads to one length to stack the pair.
    cfg_batch_output_like: (transformer, call kwargs) -> (shape, dtype, device) of the output before it runs.
    text_read_indices: (pipe, bound encode_prompt arguments) -> hidden-state indices its encode_prompt reads.
    padded_text_attention: batch invariance must run attention one sample at a time (padded text changes sums).
    rope_host_sync_classes: rope modules whose host copies the rope cache removes (`host_syncs`).
    grouped_mm_offsets: the MoE experts need compile_fixes' int32-offset work-around.
    one_frame_vae: the pipeline's video VAE decodes a one-frame latent as a 2-D network (`one_frame_vae`).
    streams_video: the VAE decodes in calls of whole frames, so the MP4 can be encoded while it decodes.
    compile_text_encoder: the text encoder is a decoder LLM worth compiling whole (`compile` extras).
    """

    cfg_batch_guidance: Callable[[Any], bool] | None = None
    cfg_batch_text_inputs: tuple[str, str] | None = None
    cfg_batch_output_like: Callable[[Any, dict], tuple | None] | None = None
    text_read_indices: Callable[[Any, dict], list[int]] | None = None
    padded_text_attention: bool = False
    rope_host_sync_classes: tuple[str, ...] = ()
    grouped_mm_offsets: bool = False
    one_frame_vae: bool = False
    streams_video: bool = False
    compile_text_encoder: bool = False


@dataclass(frozen=True)
class FamilyRecord:
    """One model family: its pipelines, transformer classes, parallel plan, limits, facts and builders.

    name: the family's id (``flux``; built-in models are ``tiny-<name>`` / ``full-<name>``).
    title: how the README names it ("FLUX.1").
    kind: "image" or "video" (what its text pipelines return).
    pipelines: diffusers pipeline class name -> task (`TASKS`). A local folder whose model_index.json names one
        of these loads as this family.
    transformers: the diffusers transformer class names (a subclass of one resolves to this family).
    sp: the sequence / expert / CFG parallel plan (`SequenceParallelFacts`).
    limits: request size rules (`SizeLimits`).
    facts: what the features need (`FeatureFacts`).
    specs: the built-in models (``ModelSpec``: tiny-*, full-* where published dimensions exist).
    build: (size, *, dtype, device, seed, **extra) -> the pipeline of a built-in size.
    build_transformer: (size, *, dtype, device, seed, **extra) -> the transformer alone (step benchmarks).
    real_weights_example: a published checkpoint named in the random-weights notice.
    pipeline_worlds: worlds of the CPU pipeline-level equivalence test.
    """

    name: str
    title: str
    kind: str
    pipelines: Mapping[str, str]
    transformers: tuple[str, ...]
    sp: SequenceParallelFacts
    limits: SizeLimits = field(default_factory=SizeLimits)
    facts: FeatureFacts = field(default_factory=FeatureFacts)
    specs: tuple = ()
    build: Callable[..., Any] | None = None
    build_transformer: Callable[..., Any] | None = None
    real_weights_example: str = "a diffusers checkpoint"
    pipeline_worlds: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("image", "video"):
            raise ValueError(f"expected kind 'image' or 'video' for family {self.name!r}, got {self.kind!r}")
        bad = {p: t for p, t in self.pipelines.items() if t not in TASKS}
        if bad:
            raise ValueError(f"expected pipeline tasks in {TASKS} for family {self.name!r}, got {bad}")
        if not self.transformers:
            raise ValueError(f"expected at least one transformer class for family {self.name!r}, got none")
