"""`FamilyRecord`: everything the package knows about one model family, in one value.

One file per family (``xstage_dit/families/<family>.py``) defines ``RECORD = FamilyRecord(...)``; the registry
(`xstage_dit.families.registry`) finds every such module of this package, so adding a family is that one file
plus its test. Features, the engine, the server, the CLI and the benchmark read model facts from the record that
`registry.record_for_transformer` / `record_for_pipeline` return, never from class-name tables of their own.
A family file never imports a feature: what it hands a feature that lives above it (an attention processor, an
EP layer) is named as a ``"module:attribute"`` string the feature resolves.

Example (``families/flux.py``, shortened)::

    RECORD = FamilyRecord(
        name="flux", title="FLUX.1", kind="image",
        pipelines={"FluxPipeline": "t2i"},
        transformers=("FluxTransformer2DModel",),
        sp=SequenceParallelFacts(plan_source="diffusers", build=shipped_plan(), check=check_parallel,
                                 guidance_distilled_key="guidance_embeds"),
        limits=SizeLimits(patch_multiple=16),
        specs=(ModelSpec(name="tiny-flux", family="flux", ...), ModelSpec(name="full-flux", family="flux", ...)),
        build=build, build_transformer=build_transformer, transformer_dims=TRANSFORMER,
        real_weights_example="FLUX.1-dev", pipeline_worlds=(2, 4),
    )

A MoE family adds ``experts=ExpertFacts(...)`` (`families/nucleusmoe.py`, `families/hidream.py`); the facts the
features read go in ``facts=FeatureFacts(...)``; a plan of our own is a function of the transformer returning a
`sp_plan.SequenceParallelSpec` (its hooks are `sp_plan.PlanHook` subclasses). A family module must import neither
diffusers nor transformers at module level (build functions import them when called): the CLI's pre-checks read
every record in about the time of ``--help``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from xstage_dit.families.spec import ModelSpec

TASKS = ("t2i", "t2v", "i2v", "edit", "i2i", "inpaint")
#: the tasks `generate` and `serve` run (a prompt, and for the image-conditioned ones images, in; an image or a
#: video out), and the kind each returns
SERVED_TASKS = {"t2i": "image", "t2v": "video", "edit": "image", "i2i": "image", "inpaint": "image", "i2v": "video"}
#: tasks whose pipelines take conditioning images (each needs `ImageInputFacts` in its record)
IMAGE_TASKS = ("i2v", "edit", "i2i", "inpaint")
CFG_STYLES = ("paired", "batched", None)
#: how one pipeline call makes several prompts' outputs from the same input images (`ImageInputFacts.batch`)
IMAGE_BATCH_MODES = ("shared", "per_prompt", "alone")


@dataclass(frozen=True)
class SequenceParallelFacts:
    """How `parallelize` shards this family's transformer over the sp (and cfg) ranks.

    plan_source: "diffusers" (its shipped ``_cp_plan``) or a short phrase naming our plan ("xstage", ...).
    build: transformer -> ``SequenceParallelSpec`` (`families.sp_plan`: the plan, the K/V layouts, processor
        swaps, extra hooks).
    check: (transformer, ParallelConfig) -> None, raising ValueError naming a rule of the model (or None).
    cfg: "paired" (two transformer calls a step, cond then uncond), "batched" (one call on an (uncond, cond)
        batch) or None (no CFG parallel).
    cfg_batch_dims: batched CFG only: input name -> its batch dim.
    cfg_needs_guidance: the pipeline runs its second CFG branch only when ``guidance_scale > 1`` (so cfg=2 asks
        for it; the CLI checks it before any rank starts).
    guidance_distilled_key: a transformer config key whose true value means guidance-distilled (one branch a
        step: no CFG parallel), e.g. FLUX.1-dev's ``guidance_embeds``; None where there is none.
    heads_key: the transformer config key of its attention heads (each sp rank needs at least one).
    """

    plan_source: str
    build: Callable[[Any], Any]
    check: Callable[[Any, Any], None] | None = None
    cfg: str | None = "paired"
    cfg_batch_dims: Mapping[str, int] = field(default_factory=dict)
    cfg_needs_guidance: bool = False
    guidance_distilled_key: str | None = None
    heads_key: str = "num_attention_heads"

    def __post_init__(self) -> None:
        if self.cfg not in CFG_STYLES:
            raise ValueError(f"expected cfg in {CFG_STYLES}, got {self.cfg!r}")


@dataclass(frozen=True)
class ExpertFacts:
    """A MoE family's routed experts: what expert parallelism swaps and how experts are made or read per rank
    (`families.experts`: built-in models draw each expert from its own seed; a local folder's are read only for
    this rank's range).

    layer_class: diffusers class name of the MoE layer. ep_layer: ``"module:Class"`` of the EP layer replacing it.
    count_key: the transformer config key of the expert count (the CLI checks ep divides it).
    ep_equals_sp: routing picks tokens over the whole sequence (expert choice): under sp the MoE layers must be
        the EP layers over the sp group, ep == sp.
    meta_experts: () -> context manager under which the transformer is built with its experts on meta.
    num_experts: layer -> its expert count. dims: layer -> (hidden, inter).
    random_experts: (layer_name, lo, hi, seed, hidden, inter, device, dtype) -> (gate_up (n, hidden, 2 inter),
        down (n, inter, hidden)), experts [lo, hi) of a built-in model.
    read_experts: (safetensors reader, layer_name, lo, hi) -> (gate_up, down) of a local folder.
    materialize: (layer, gate_up, down) -> None: the whole diffusers layer (world 1).
    """

    layer_class: str
    ep_layer: str
    count_key: str
    meta_experts: Callable[[], contextlib.AbstractContextManager]
    num_experts: Callable[[Any], int]
    dims: Callable[[Any], tuple[int, int]]
    random_experts: Callable[..., tuple]
    read_experts: Callable[..., tuple]
    materialize: Callable[..., None]
    ep_equals_sp: bool = False


@dataclass(frozen=True)
class SizeLimits:
    """What sizes a request may ask for (checked before a request is queued: a 4xx naming the field).

    patch_multiple: height and width must be multiples of this (VAE factor x patch size) for the published
        checkpoint (a local folder); a built-in ``full-*`` spec must agree, a tiny one states its own.
    frame_multiple: video: (frames - 1) must be a multiple of this (published checkpoint, as above).
    square_under_sp: the transformer takes only square latents at sp > 1 (HiDream): the request's width must
        equal its height there.
    """

    patch_multiple: int = 16
    frame_multiple: int = 1
    square_under_sp: bool = False


@dataclass(frozen=True)
class VideoVAEFacts:
    """A diffusers video VAE whose decode the features speed up (`one_frame_vae`, `server.video_stream`).

    vae_class: its class name. causal_conv_class: its causal 3-D convolution that pads time with zero frames in
        front (``_padding[4] == kernel frames - 1``) and takes the previous chunk's frames as ``cache_x``.
    one_frame_decode: ``_decode`` runs ``decoder(frame, feat_cache=..., feat_idx=...)`` once per latent frame and
        the decoder computes a first frame without the cache as with a fresh one (a one-frame decode may skip it).
    streams_frames: each decoder call returns whole frames in order (the MP4 can be encoded while it decodes).
    """

    vae_class: str
    causal_conv_class: str
    one_frame_decode: bool = True
    streams_frames: bool = False


@dataclass(frozen=True)
class ImageInputFacts:
    """How one pipeline class takes conditioning images: its ``__call__`` in diffusers 0.42.1.

    argument: the keyword the images go to (``image``).
    max_images: how many it takes; min_images: how many it needs (0: it also runs from text alone, e.g. FLUX.1
        Kontext and FLUX.2).
    as_list: the images go as one list, several references of one prompt (FLUX.2, Qwen-Image-Edit Plus); else one
        image under `argument` and the next ones one each under `extra_arguments` (else max_images is 1).
    extra_arguments: the keywords of the images after the first, in order, one image each (Wan's first-last-frame
        ``last_image``).
    checkpoint_counts: transformer config -> (min_images, max_images) of that checkpoint, where the class's call
        takes more than some of its checkpoints can (Wan 2.1's last frame needs the FLF2V transformer, which needs
        it); None: the counts above for every checkpoint. `for_transformer` applies it.
    output_size: (transformer config, image width, image height) -> the (width, height) the pipeline makes from its
        first image, for a pipeline that takes no height / width (HunyuanVideo 1.5 I2V picks a size bucket from the
        image); a request's size must be that one. None: the request's size goes to the pipeline. `made_size` calls
        it on facts resolved by `for_transformer` (which keep that config in ``transformer_config``).
    mask_argument: the keyword of the mask (FLUX.1 Fill's ``mask_image``: white = repaint); None: takes no mask.
    area_argument: a keyword the output area goes to: FLUX.1 Kontext rescales width x height to ``max_area``, so it
        gets width * height and makes the size asked for.
    batch: how one call makes several prompts' outputs from the same images: "shared" (passed once; the pipeline
        repeats them for every prompt), "per_prompt" (one copy per prompt: LTX-Video and CogVideoX encode
        ``image[i]`` with ``generator[i]``), "alone" (one prompt a call: the Qwen-Image edits take one).
    size_from_image: a request without a size makes the first image's size (rounded down to the patch multiple), as
        the edit pipelines do; else the model's default size (image-to-video: the image is resized to it).
    min_side / max_aspect: each image's width and height at least min_side pixels, and its long side at most
        max_aspect times its short side (FLUX.2's reference check: 64 and 8); 0 where the pipeline has no such rule.
    """

    argument: str = "image"
    max_images: int = 1
    min_images: int = 1
    as_list: bool = False
    extra_arguments: tuple[str, ...] = ()
    checkpoint_counts: Callable[[Mapping], tuple[int, int]] | None = None
    output_size: Callable[[Mapping, int, int], tuple[int, int]] | None = None
    transformer_config: Mapping | None = field(default=None, compare=False, repr=False)
    mask_argument: str | None = None
    area_argument: str | None = None
    batch: str = "shared"
    size_from_image: bool = True
    min_side: int = 0
    max_aspect: float = 0

    def __post_init__(self) -> None:
        if not 0 <= self.min_images <= self.max_images or self.max_images < 1:
            raise ValueError(f"expected 0 <= min_images <= max_images and max_images >= 1, got {self.min_images} and "
                             f"{self.max_images}")
        if self.max_images > 1 + len(self.extra_arguments) and not self.as_list:
            raise ValueError(f"expected as_list=True or {self.max_images - 1} extra_arguments for a pipeline taking "
                             f"{self.max_images} images, got as_list=False and {list(self.extra_arguments)}")
        if self.as_list and self.extra_arguments:
            raise ValueError(f"expected as_list or extra_arguments, got both ({list(self.extra_arguments)})")
        if self.batch not in IMAGE_BATCH_MODES:
            raise ValueError(f"expected batch in {IMAGE_BATCH_MODES}, got {self.batch!r}")

    @property
    def per_checkpoint(self) -> bool:
        """Some of these facts depend on the checkpoint's transformer config (`for_transformer` resolves them)."""
        return self.checkpoint_counts is not None or (self.output_size is not None and self.transformer_config is None)

    def for_transformer(self, config: Mapping) -> "ImageInputFacts":
        """These facts for the checkpoint whose transformer config is `config` (`checkpoint_counts`, and the config
        `output_size` reads); ValueError when the rule gives counts outside the class's."""
        if not self.per_checkpoint:
            return self
        low, high = (self.min_images, self.max_images) if self.checkpoint_counts is None \
            else self.checkpoint_counts(config)
        if not self.min_images <= low <= high <= self.max_images:
            raise ValueError(f"expected checkpoint counts within {self.min_images}..{self.max_images}, got "
                             f"{low}..{high}")
        return replace(self, min_images=low, max_images=high, checkpoint_counts=None, transformer_config=dict(config))

    def made_size(self, width: int, height: int) -> tuple[int, int] | None:
        """(width, height) the pipeline makes from a first image of width x height where it sizes its output itself
        (`output_size`); None where the request's size goes to the pipeline. ValueError on the class's facts (not
        resolved for a checkpoint)."""
        if self.output_size is None:
            return None
        if self.transformer_config is None:
            raise ValueError("expected image-input facts resolved for a checkpoint (for_transformer), got the class's")
        return self.output_size(self.transformer_config, width, height)


@dataclass(frozen=True)
class FeatureFacts:
    """The per-family facts the features read (each None / empty where the feature does not apply).

    cfg_batch_guidance: pipeline -> whether its current call runs CFG (CFG batching arms on it).
    cfg_batch_text_inputs: (text input, its padding mask) CFG batching pads to one length to stack the pair.
    cfg_batch_output_like: (transformer, call kwargs) -> (shape, dtype, device) of the output before it runs.
    text_read_indices: (pipe, bound encode_prompt arguments) -> hidden-state indices its encode_prompt reads.
    padded_text_attention: batch invariance must run attention one sample at a time (padded text changes sums).
    rope_host_sync_classes: rope modules whose host copies the rope cache removes (`host_syncs`).
    grouped_mm_expert_classes: expert modules that need compile_fixes' int32-offset work-around for grouped_mm.
    video_vae: the video VAE of the family's pipelines (`VideoVAEFacts`), None for others.
    fp8_skip: module-path patterns (fnmatch, relative to the transformer) of linear layers the `fp8` feature keeps
        in their dtype (e.g. the final projection to latents); every other eligible nn.Linear goes to float8.
    fp8_row_refused: module-path patterns of linear layers torch's row-wise FP8 GEMM refuses on the GPUs measured
        (cuBLASLt finds no algorithm for the shape: "CUBLAS_STATUS_NOT_SUPPORTED"); the row-wise `fp8` feature and
        the peers' FP8 recipe in the benchmark keep them in their dtype, and say so.
    fp8_expert_classes: grouped-GEMM expert modules the `fp8` feature runs on the grouped FP8 GEMM
        (`features.fp8_experts`: ``gate_up_proj`` (E, hidden, 2 inter), ``down_proj`` (E, inter, hidden), a grouped
        path ``_run_experts_grouped_mm(x, num_tokens_per_expert)``).
    """

    cfg_batch_guidance: Callable[[Any], bool] | None = None
    cfg_batch_text_inputs: tuple[str, str] | None = None
    cfg_batch_output_like: Callable[[Any, dict], tuple | None] | None = None
    text_read_indices: Callable[[Any, dict], list[int]] | None = None
    padded_text_attention: bool = False
    rope_host_sync_classes: tuple[str, ...] = ()
    grouped_mm_expert_classes: tuple[str, ...] = ()
    video_vae: VideoVAEFacts | None = None
    fp8_skip: tuple[str, ...] = ()
    fp8_row_refused: tuple[str, ...] = ()
    fp8_expert_classes: tuple[str, ...] = ()


@dataclass(frozen=True)
class FamilyRecord:
    """One model family: its pipelines, transformer classes, parallel plan, limits, facts and builders.

    name: the family's id (``flux``; built-in models are ``tiny-<name>`` / ``full-<name>``).
    title: how the README names it ("FLUX.1").
    kind: "image" or "video" (what its text pipelines return).
    pipelines: diffusers pipeline class name -> task (`TASKS`). A local folder whose model_index.json names one
        of these loads as this family; `generate` and `serve` run the `SERVED_TASKS` ones. Empty for a family
        that has no DiffusionPipeline (a modular pipeline: `parallelize` from Python only).
    transformers: the diffusers transformer class names (a subclass of one resolves to this family).
    sp: the sequence / CFG parallel plan (`SequenceParallelFacts`).
    experts: the routed experts of a MoE family (`ExpertFacts`), None for a dense one.
    limits: request size rules (`SizeLimits`).
    facts: what the features need (`FeatureFacts`).
    specs: the built-in models (``ModelSpec``: tiny-*, full-* where published dimensions exist); each must name
        this family, its kind and one of its served pipelines (checked here); the record's square rule and
        real-weights example are set on them (``ModelSpec.square_under_sp`` / ``real_weights_example``).
    build: (size, *, dtype, device, seed, **extra) -> the pipeline of a built-in size.
    build_transformer: (size, *, dtype, device, seed, **extra) -> the transformer alone (step benchmarks).
    transformer_dims: size -> the transformer config of a built-in size (what the CLI's pre-checks read).
    real_weights_example: a published checkpoint named in the random-weights notice.
    pipeline_worlds: worlds of the CPU pipeline-level equivalence test.
    latent_decode: (pipe, step latents, height, width) -> the VAE's output (batch, C, H, W): the decode tail of
        the family's text-to-image pipeline (`families.latent_decode`), which the server runs on a step's latents
        for a stream's partial images; None where the family has none (no previews).
    image_inputs: pipeline class -> how it takes conditioning images (`ImageInputFacts`): every pipeline of an
        image task (`IMAGE_TASKS`) has one, a text pipeline may take optional ones (FLUX.2's references); a pipeline
        without one takes no image.
    """

    name: str
    title: str
    kind: str
    pipelines: Mapping[str, str]
    transformers: tuple[str, ...]
    sp: SequenceParallelFacts
    experts: ExpertFacts | None = None
    limits: SizeLimits = field(default_factory=SizeLimits)
    facts: FeatureFacts = field(default_factory=FeatureFacts)
    specs: tuple = ()
    build: Callable[..., Any] | None = None
    build_transformer: Callable[..., Any] | None = None
    transformer_dims: Mapping[str, dict] = field(default_factory=dict)
    real_weights_example: str = "a diffusers checkpoint"
    pipeline_worlds: tuple[int, ...] = ()
    latent_decode: Callable[[Any, Any, int, int], Any] | None = None
    image_inputs: Mapping[str, ImageInputFacts] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ("image", "video"):
            raise ValueError(f"expected kind 'image' or 'video' for family {self.name!r}, got {self.kind!r}")
        bad = {p: t for p, t in self.pipelines.items() if t not in TASKS}
        if bad:
            raise ValueError(f"expected pipeline tasks in {TASKS} for family {self.name!r}, got {bad}")
        if not self.transformers:
            raise ValueError(f"expected at least one transformer class for family {self.name!r}, got none")
        # every image task's pipeline says how it takes images; a text pipeline may take optional ones (FLUX.2)
        wrong_images = sorted({p for p, t in self.pipelines.items() if t in IMAGE_TASKS} - set(self.image_inputs)
                              | {p for p, f in self.image_inputs.items() if p not in self.pipelines
                                 or (self.pipelines[p] not in IMAGE_TASKS and f.min_images)})
        if wrong_images:
            raise ValueError(f"expected ImageInputFacts for the image-conditioned pipelines {IMAGE_TASKS} of family "
                             f"{self.name!r} (and optional images only on its others), got a mismatch for "
                             f"{wrong_images}")
        if self.specs and self.build is None:
            raise ValueError(f"expected a build function for family {self.name!r} with built-in models, got None")
        object.__setattr__(self, "specs", tuple(self._checked(s) for s in self.specs))

    @property
    def served_pipelines(self) -> tuple[str, ...]:
        """The pipeline classes `generate` and `serve` run for this family (text in, its kind out)."""
        return tuple(p for p, t in self.pipelines.items() if SERVED_TASKS.get(t) == self.kind)

    def spec(self, size: str, pipeline: str | None = None) -> ModelSpec | None:
        """The built-in spec of `size` ("tiny", "full") running `pipeline` (a class name; None: the family's first
        of that size), or None."""
        return next((s for s in self.specs if s.size == size and pipeline in (None, s.pipeline_class)), None)

    def dims(self, spec: ModelSpec) -> dict:
        """The transformer config of a built-in spec: ``transformer_dims["<size>-<variant>"]`` where the variant has
        its own transformer (FLUX.1 Fill, Wan I2V), else ``transformer_dims[size]``."""
        key = f"{spec.size}-{spec.variant}"
        return dict(self.transformer_dims[key if spec.variant and key in self.transformer_dims else spec.size])

    def _checked(self, spec: ModelSpec) -> ModelSpec:
        if not isinstance(spec, ModelSpec):
            raise ValueError(f"expected ModelSpec values in the specs of family {self.name!r}, got {spec!r}")
        wrong = {what: (got, want) for what, got, want in (
            ("family", spec.family, self.name), ("kind", spec.kind, self.kind))
            if got != want}
        if spec.pipeline_class not in self.served_pipelines:
            wrong["pipeline_class"] = (spec.pipeline_class, self.served_pipelines)
        if spec.size == "full":
            for what in ("patch_multiple", "frame_multiple"):
                if getattr(spec, what) != getattr(self.limits, what):
                    wrong[what] = (getattr(spec, what), getattr(self.limits, what))
        if wrong:
            raise ValueError(f"expected {spec.name} to agree with its family record {self.name!r}, got "
                             + ", ".join(f"{k}={got!r} (record: {want!r})" for k, (got, want) in wrong.items()))
        return replace(spec, square_under_sp=self.limits.square_under_sp,
                       real_weights_example=self.real_weights_example)
