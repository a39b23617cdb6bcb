"""What the server serves and the limits it enforces: `ServedModel` (facts about the one model this
server runs) and `ServerConfig` (queue, batching, timeouts, request bounds, auth, and the one
`ParallelConfig` of the command), both validated on construction so a bad value fails at start-up with
the option's name."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from xstage_dit.features.config import ParallelConfig

if TYPE_CHECKING:
    import torch

    from xstage_dit.families.record import ImageInputFacts

#: Environment variable holding the optional bearer token (unset or empty: no authentication).
API_KEY_ENV = "XSTAGE_API_KEY"
#: endpoints whose bodies carry images (ServerConfig.max_upload_bytes instead of max_body_bytes)
UPLOAD_PATHS = ("/v1/images/edits", "/v1/videos")
VIDEO_STREAM_POLICIES = ("gpu", "always", "never")  # ServerConfig.video_stream


def _check(cond: bool, what: str, expected: str, got: Any) -> None:
    if not cond:
        raise ValueError(f"{what}: expected {expected}, got {got!r}")


@dataclass(frozen=True)
class ServedModel:
    """The model behind the server.

    name: what clients pass as `model` (a registry name such as "tiny-flux", or the folder's base name).
    kind: "image" or "video".
    size_multiple: width and height must be multiples of this many pixels (VAE factor x patch size).
    default_width/default_height, default_steps, default_guidance: used when a request omits them.
    default_frames / frame_multiple: video only; valid frame counts are `k * frame_multiple + 1`.
    pipeline_kwargs: fixed extra keyword arguments for every pipeline call (e.g. max_sequence_length),
        `xstage_dit.runtime.generation.fixed_kwargs` of the spec.
    weights_notice: set when the weights are random (a built-in model): what to tell users, and how to
        use real weights; None for real weights.
    square_only: width must equal height (HiDream at sp > 1: `ModelSpec.square_under_sp`); a request of another
        size gets 400 naming ``size`` before it is queued.
    previews: the family record has a decode tail for step latents (``FamilyRecord.latent_decode``): a stream
        may ask for partial images (`server.previews`).
    image_inputs: how the pipeline takes input images (`ImageInputFacts` of its family record: image edit,
        image-to-video), None when it takes none.
    warm_with_images: the pipeline's task is an image one (edit, image-to-video, ...): warm-ups run with synthetic
        input images (`conditioning.warmup_inputs`), the shapes its requests have.
    lora: the LoRA manager (`features.lora.LoraManager`: the adapters requests may name, which are resident) of
        rank 0; None: the server serves no LoRA.
    step_cache: the step cache the pipeline runs (`StepCacheConfig.describe()`: method and parameters), None for
        none; cache_threshold: whether a request may set its own threshold (``cache_threshold``).
    """

    name: str
    kind: str
    size_multiple: int
    default_width: int
    default_height: int
    default_steps: int
    default_guidance: float
    default_frames: int = 1
    frame_multiple: int = 4
    default_fps: int = 16
    pipeline_kwargs: dict = field(default_factory=dict)
    weights_notice: str | None = None
    square_only: bool = False
    previews: bool = False
    image_inputs: ImageInputFacts | None = None
    warm_with_images: bool = False
    lora: Any = field(default=None, compare=False, repr=False)
    step_cache: dict | None = None
    cache_threshold: bool = False

    def __post_init__(self) -> None:
        _check(bool(self.name), "model name", "a non-empty string", self.name)
        _check(self.kind in ("image", "video"), "model kind", "'image' or 'video'", self.kind)
        _check(self.size_multiple >= 1, "size_multiple", ">= 1", self.size_multiple)
        for what in ("default_width", "default_height"):
            value = getattr(self, what)
            _check(value > 0 and value % self.size_multiple == 0, what,
                   f"a positive multiple of {self.size_multiple}", value)
        _check(self.default_steps >= 1, "default_steps", ">= 1", self.default_steps)
        _check(self.default_frames >= 1, "default_frames", ">= 1", self.default_frames)
        _check(self.frame_multiple >= 1, "frame_multiple", ">= 1", self.frame_multiple)

    @classmethod
    def from_spec(cls, name: str, spec: Any, sp: int = 1) -> "ServedModel":
        """Build from `xstage_dit.families.model_spec(name)` (a ModelSpec: kind, patch multiple, defaults), served
        on `sp` sequence-parallel ranks."""
        from xstage_dit.families.record import IMAGE_TASKS
        from xstage_dit.families.registry import image_inputs_for_model, record_for_pipeline
        from xstage_dit.runtime.generation import fixed_kwargs

        family = record_for_pipeline(spec.pipeline_class)
        return cls(name=name, kind=spec.kind, size_multiple=spec.patch_multiple, default_width=spec.width,
                   default_height=spec.height, default_steps=spec.steps, default_guidance=float(spec.guidance),
                   default_frames=spec.frames, frame_multiple=spec.frame_multiple, default_fps=spec.fps,
                   pipeline_kwargs=fixed_kwargs(spec), weights_notice=spec.weights_notice,
                   square_only=bool(spec.square_under_sp and sp > 1),
                   previews=spec.kind == "image" and family is not None and family.latent_decode is not None,
                   image_inputs=image_inputs_for_model(spec),
                   warm_with_images=family is not None and family.pipelines.get(spec.pipeline_class) in IMAGE_TASKS)


@dataclass(frozen=True)
class ServerConfig:
    """Limits and behaviour of the server. Every bound a client can hit is here.

    max_queue: jobs waiting (not yet running) before new ones get 429 with Retry-After.
    max_batch_size: images (or videos) run in one pipeline call when requests are compatible
        (same kind, size, steps, guidance, frames); 1 disables batching.
    batch_wait_s: how long the worker waits for more compatible requests before starting a batch.
    request_timeout_s: a job not finished this long after it was submitted fails with 504; a running
        one stops at the next step.
    max_body_bytes: request bodies larger than this get 413.
    max_upload_bytes: the limit instead for the endpoints that take image uploads (`UPLOAD_PATHS`: image edits,
        videos with an input reference).
    max_image_pixels: an input image (or mask) with more pixels than this, read from its header before any
        decoding (a decompression bomb stays compressed), gets 422 naming its field.
    max_n, max_steps, max_prompt_chars, min_size, max_size, max_pixels, max_frames: request bounds.
    job_ttl_s / max_stored_jobs: finished jobs (and their video bytes) are kept this long / this many.
    api_key: bearer token required on /v1/*; None disables auth. Defaults to $XSTAGE_API_KEY.
    heartbeat_timeout_s: a rank that has not signalled for this long is considered dead.
    exit_after_failure_s: after a rank failure, keep answering 503 this long, then exit non-zero
        (so a process manager restarts the server); None keeps running.
    warmup: run two steps at the model's default size and at each of `warmup_sizes` on every rank before
        reporting ready (compiling those shapes when the loader compiled the transformer); /health is 200
        only afterwards.
    warmup_sizes: extra (width, height) sizes to warm up (and, with batching "auto", to measure).
    gc_freeze: after warm-up, move every object alive into the garbage collector's permanent generation
        (`xstage_dit.runtime.gc_pauses`): a full collection then walks only what requests allocated, instead of
        pausing a request for the whole loaded heap (benchmarks/results/serving/NOTES.md, "The heap frozen").
    keep_freed_memory: before warm-up, fix glibc's mmap and trim thresholds (`xstage_dit.runtime.malloc_heap`) so
        each answer's multi-megabyte buffers reuse the heap instead of page-faulting on fresh mappings; process-wide.
    video_stream: encode a video's MP4 while its VAE decodes (`xstage_dit.server.video_stream`): "gpu" where
        the pipeline runs on a GPU (the decode is GPU work and the host's cores are free for x264), "always",
        "never". On a 2-core CPU machine, where the VAE decodes on the same cores, streaming made tiny Wan's
        request slower: x264's threads slow the decode more than they save (benchmarks/results/serving/NOTES.md).
    batching: "auto" batches a size only where warm-up measured a batch of max_batch_size at >= 1 +
        batch_margin times the images per second of single images, with bit-identical images (else FIFO,
        one pipeline call per image); "always" batches every compatible request; "never" is FIFO.
    batch_margin: the images/s gain a batch must show (0.10 = 10 %).
    stop_check_steps: the ranks agree on cancellation every this many steps (a non-blocking vote read one
        vote late): a cancelled batch stops within 2x this many steps, and no step waits for it.
    parallel: the degrees of parallelism (sp, ep, cfg) and the collective timeout, built once by the
        command and handed whole to every rank's loader (`xstage_dit.server.startup.model_loader`).
    """

    max_queue: int = 64
    max_batch_size: int = 4
    batch_wait_s: float = 0.02
    request_timeout_s: float = 600.0
    max_body_bytes: int = 64 * 1024
    max_upload_bytes: int = 64 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    max_n: int = 4
    max_steps: int = 100
    max_prompt_chars: int = 2000
    min_size: int = 16
    max_size: int = 2048
    max_pixels: int = 2048 * 2048
    max_frames: int = 161
    job_ttl_s: float = 3600.0
    max_stored_jobs: int = 256
    api_key: str | None = field(default_factory=lambda: os.environ.get(API_KEY_ENV) or None)
    heartbeat_timeout_s: float = 5.0
    exit_after_failure_s: float | None = 30.0
    warmup: bool = True
    warmup_sizes: tuple = ()
    gc_freeze: bool = True
    keep_freed_memory: bool = True
    video_stream: str = "gpu"
    batching: str = "auto"
    batch_margin: float = 0.10
    stop_check_steps: int = 1
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        for what in ("max_queue", "max_batch_size", "max_body_bytes", "max_upload_bytes", "max_image_pixels", "max_n", "max_steps", "max_prompt_chars",
                     "min_size", "max_size", "max_pixels", "max_frames", "max_stored_jobs"):
            value = getattr(self, what)
            _check(isinstance(value, int) and value >= 1, what, "an integer >= 1", value)
        _check(self.min_size <= self.max_size, "min_size", f"<= max_size ({self.max_size})", self.min_size)
        for what in ("batch_wait_s", "request_timeout_s", "job_ttl_s", "heartbeat_timeout_s"):
            value = getattr(self, what)
            _check(math.isfinite(value) and value >= 0, what, "a finite number >= 0", value)
        _check(self.batching in ("auto", "always", "never"), "batching", "auto, always or never", self.batching)
        _check(math.isfinite(self.batch_margin) and self.batch_margin >= 0, "batch_margin", "a number >= 0",
               self.batch_margin)
        _check(isinstance(self.stop_check_steps, int) and self.stop_check_steps >= 1, "stop_check_steps",
               "an integer >= 1", self.stop_check_steps)
        _check(isinstance(self.gc_freeze, bool), "gc_freeze", "True or False", self.gc_freeze)
        _check(isinstance(self.keep_freed_memory, bool), "keep_freed_memory", "True or False",
               self.keep_freed_memory)
        _check(self.video_stream in VIDEO_STREAM_POLICIES, "video_stream", "gpu, always or never",
               self.video_stream)
        for size in self.warmup_sizes:
            _check(isinstance(size, tuple) and len(size) == 2 and all(isinstance(v, int) and v >= 1 for v in size),
                   "warmup_sizes", "(width, height) pairs of positive integers", size)
        _check(self.request_timeout_s > 0, "request_timeout_s", "> 0", self.request_timeout_s)
        _check(isinstance(self.parallel, ParallelConfig), "parallel", "a ParallelConfig", self.parallel)
        if self.exit_after_failure_s is not None:
            _check(self.exit_after_failure_s >= 0, "exit_after_failure_s", ">= 0 or None", self.exit_after_failure_s)

    def streams_video(self, device: torch.device) -> bool:
        """Whether a video made on `device` is encoded while its VAE decodes (`video_stream`)."""
        return self.video_stream == "always" or (self.video_stream == "gpu" and device.type == "cuda")
