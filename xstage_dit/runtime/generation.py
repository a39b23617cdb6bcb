"""One generation request, one rule for the pipeline's keyword arguments and its generators, and saving
what a pipeline makes (PNG, MP4 or a PNG grid of frames).

Shared by ``xstage-dit generate``, the server and the benchmarks, so the same prompt, seed, size and step
count give the same image from each of them: every image's initial noise comes from a CPU generator seeded
with its own seed (``seed + i`` for the i-th image of a request), whatever the device, and pixels are
rounded to uint8 by one rule (`to_uint8`).

Example::

    request = request_for(spec, prompt="a red fox", seed=7)
    out = run_pipeline(pipe, **pipeline_kwargs(pipe, [request], kind=spec.kind, fixed=fixed_kwargs(spec)))
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from xstage_dit.runtime.conditioning import InputImages, default_size, image_kwargs, made_size
from xstage_dit.runtime.mp4 import encode_mp4
from xstage_dit.runtime.png import encode_png
from xstage_dit.families.registry import image_inputs_for, image_inputs_for_model
from xstage_dit.families.spec import ModelSpec

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_SUFFIXES = (".mp4",)
MAX_SEED = 2**63 - 1
# Fixed arguments a pipeline may lack (a local folder's class): dropped there instead of failing the call.
_OPTIONAL_FIXED = ("max_sequence_length",)


@dataclass(frozen=True)
class GenerationRequest:
    """`n` images (or one video) of one prompt, every value resolved (no model defaults left to apply).

    kind: "image" or "video". width/height: pixels. steps: denoising steps. guidance: guidance scale.
    seed: seed of the first image; image i uses ``seed + i`` (see `generators_for`).
    true_cfg_scale: true classifier-free guidance, for pipelines that have it (None: not passed).
    frames / fps: video only (frames is 1 for images).
    inputs: the conditioning images (image edit, image-to-video: `conditioning.InputImages`), None for text alone.
    lora: the LoRA adapters of the call, ``((name, scale), ...)`` in the order their deltas are summed (empty: none;
        `features.lora.adapter_list` checks a client's list).
    cache_threshold: this request's step-cache threshold (`features.step_cache`; None: the server's own).
    Requests with equal `batch_key` can share one pipeline call (with input images: the same images).
    """

    kind: str
    prompt: str
    width: int
    height: int
    steps: int
    guidance: float
    seed: int = 0
    negative_prompt: str | None = None
    true_cfg_scale: float | None = None
    num_frames: int = 1
    fps: int = 16
    n: int = 1
    inputs: InputImages | None = None
    lora: tuple = ()
    cache_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("image", "video"):
            raise ValueError(f"expected kind 'image' or 'video', got {self.kind!r}")
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ValueError(f"expected a non-empty prompt, got {self.prompt!r}")
        for name in ("width", "height", "steps", "num_frames", "fps", "n"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"expected {name} to be an integer >= 1, got {value!r}")
        if not math.isfinite(self.guidance) or self.guidance < 0:
            raise ValueError(f"expected guidance >= 0, got {self.guidance}")
        if self.true_cfg_scale is not None and not (math.isfinite(self.true_cfg_scale) and self.true_cfg_scale >= 0):
            raise ValueError(f"expected true_cfg_scale >= 0, got {self.true_cfg_scale}")
        if not 0 <= self.seed or self.seed + self.n - 1 > MAX_SEED:
            raise ValueError(f"expected seeds seed .. seed + n - 1 in [0, 2**63-1], got seed {self.seed} with n {self.n}")
        if self.inputs is not None and not isinstance(self.inputs, InputImages):
            raise ValueError(f"expected inputs to be InputImages or None, got {type(self.inputs).__name__}")
        if not isinstance(self.lora, tuple) or not all(
                isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str) and isinstance(a[1], float)
                for a in self.lora):
            raise ValueError(f"expected lora as ((name, scale), ...) with float scales, got {self.lora!r}")
        if self.cache_threshold is not None and not (math.isfinite(self.cache_threshold) and self.cache_threshold >= 0):
            raise ValueError(f"expected cache_threshold >= 0, got {self.cache_threshold}")

    @property
    def batch_key(self) -> tuple:
        # A batch mixing items with and without a negative prompt would change the CFG path of some. Input images:
        # only the same images share a call (and a pipeline taking one prompt a call, none). One call has one LoRA
        # set: only requests of the same adapters at the same scales share it.
        return (self.kind, self.width, self.height, self.steps, self.guidance, self.num_frames,
                self.true_cfg_scale, self.negative_prompt is not None,
                None if self.inputs is None else self.inputs.key(self.seed), self.lora, self.cache_threshold)

    def per_image(self) -> list["GenerationRequest"]:
        """The `n` one-image requests of this one (seeds seed, seed+1, ...): what a server batches."""
        return [replace(self, seed=self.seed + i, n=1) for i in range(self.n)]


def request_for(spec: ModelSpec, *, prompt: str, negative_prompt: str | None = None, height: int | None = None,
                width: int | None = None, frames: int | None = None, steps: int | None = None,
                guidance: float | None = None, true_cfg_scale: float | None = None, seed: int = 0,
                n: int = 1, sp: int = 1, images: Sequence[Image.Image] = (),
                mask: Image.Image | None = None, lora: tuple = ()) -> GenerationRequest:
    """A `GenerationRequest` with `spec`'s defaults where a value is None; ValueError naming a bad value.
    sp: the sequence-parallel degree it will run at (some models take only square sizes there).
    images / mask: input images (PIL), checked against how `spec`'s pipeline takes them (`InputImages.of`:
    `conditioning.ImageInputError` naming "image" or "mask"); an edit without a size makes the first image's. lora: its adapters, ``((name, scale), ...)``."""
    facts = image_inputs_for_model(spec)
    inputs = InputImages.of(facts, images, mask, model=spec.name)
    size = default_size(facts, inputs, spec.patch_multiple) or (spec.width, spec.height)
    made = made_size(facts, inputs)
    if made is not None and (width, height) != (None, None) and (width, height) != made:
        raise ValueError(f"expected no width x height or {made[0]}x{made[1]} for {spec.name} (its pipeline sizes the "
                         f"video from the input image), got {width}x{height}")
    height = size[1] if height is None else int(height)
    width = size[0] if width is None else int(width)
    frames = spec.frames if frames is None else int(frames)
    steps = spec.steps if steps is None else int(steps)
    guidance = spec.guidance if guidance is None else float(guidance)
    spec.check_size(height, width, frames, sp=sp)
    if steps < 1:
        raise ValueError(f"expected steps >= 1, got {steps}")
    return GenerationRequest(kind=spec.kind, prompt=prompt, width=width, height=height, steps=steps,
                             guidance=guidance, seed=int(seed), negative_prompt=negative_prompt,
                             true_cfg_scale=true_cfg_scale, num_frames=frames, fps=spec.fps, n=n, inputs=inputs,
                             lora=tuple(lora))


def fixed_kwargs(spec: ModelSpec) -> dict:
    """The keyword arguments every call of `spec`'s pipeline gets (text length, the spec's call_kwargs)."""
    fixed = dict(spec.call_kwargs)
    if spec.max_sequence_length is not None:
        fixed.setdefault("max_sequence_length", int(spec.max_sequence_length))
    return fixed


def generators_for(request: GenerationRequest) -> list[torch.Generator]:
    """One CPU generator per image, seeded ``seed + i``: the same initial noise on every device and rank
    (diffusers draws each image's latents from its own generator, on the CPU, then moves them)."""
    return [torch.Generator("cpu").manual_seed(request.seed + i) for i in range(request.n)]


def pipeline_kwargs(pipe, requests: Sequence[GenerationRequest], *, kind: str, fixed: Mapping = (),
                    output_type: str = "np") -> dict:
    """Keyword arguments of one ``pipe(**kwargs)`` call making every image of `requests` (equal batch_key):
    lists of prompts and generators, one per image (plain values for a single image).

    fixed: the model's fixed arguments (`fixed_kwargs(spec)`). output_type: "np" (float pixels on the host, what
    a diffusers user gets; the benchmarks' bare calls) or "pt" (the decoded tensor where the VAE left it: the
    server and ``generate`` round it there, `output_pixels`). Input images go where the pipeline's family record
    says (`conditioning.image_kwargs`). Raises ValueError naming any argument the pipeline does not take (a negative
    prompt for a pipeline without one, an input image for one that takes none, ...).
    """
    if output_type not in ("np", "pt"):
        raise ValueError(f"expected output_type 'np' or 'pt', got {output_type!r}")
    if not requests:
        raise ValueError("expected at least one request, got none")
    keys = {r.batch_key for r in requests}
    if len(keys) != 1:
        raise ValueError(f"expected requests with one batch_key, got {len(keys)} different ones")
    first = requests[0]
    if first.kind != kind:
        raise ValueError(f"expected {kind} requests for this {kind} model, got a {first.kind} request")
    params = inspect.signature(pipe.__call__).parameters
    kwargs = {k: v for k, v in dict(fixed).items() if k in params or k not in _OPTIONAL_FIXED}
    kwargs.update(
        prompt=[r.prompt for r in requests for _ in range(r.n)],
        height=first.height,
        width=first.width,
        num_inference_steps=first.steps,
        generator=[g for r in requests for g in generators_for(r)],
        output_type=output_type,
    )
    if "guidance_scale" in params:
        kwargs["guidance_scale"] = first.guidance
    elif first.guidance not in (0.0, 1.0):
        # Qwen-Image 2.1 guides only through true_cfg_scale with a negative prompt
        raise ValueError(f"expected guidance 1 for {type(pipe).__name__} (it has no guidance_scale; use "
                         f"true_cfg_scale), got {first.guidance}")
    if first.negative_prompt is not None:
        kwargs["negative_prompt"] = [r.negative_prompt for r in requests for _ in range(r.n)]
    if first.true_cfg_scale is not None:
        kwargs["true_cfg_scale"] = first.true_cfg_scale
    if kind == "video":
        kwargs["num_frames"] = first.num_frames
    facts = image_inputs_for(pipe)
    if facts is not None:
        kwargs.update(image_kwargs(facts, first.inputs, prompts=len(kwargs["prompt"]), width=first.width,
                                   height=first.height))
        if facts.output_size is not None:  # it sizes the output from the image (the request's is that size)
            del kwargs["height"], kwargs["width"]
    elif first.inputs is not None:
        raise ValueError(f"expected no input image for {type(pipe).__name__} (it takes none), got "
                         f"{len(first.inputs.images)}")
    if len(kwargs["prompt"]) == 1:
        # One image: plain values, as a user calls a pipeline (wrappers such as xfuser's expect them); diffusers
        # draws the same noise from one generator as from a list of one.
        for key in ("prompt", "negative_prompt", "generator"):
            if key in kwargs:
                kwargs[key] = kwargs[key][0]
    unknown = sorted(k for k in kwargs if k not in params)
    if unknown:
        raise ValueError(f"expected arguments of {type(pipe).__name__}.__call__, got {unknown}")
    return kwargs


def run_pipeline(pipe, **kwargs):
    """``pipe(**kwargs)`` the way xstage runs every generation (server, ``generate``, the bench's xstage
    contenders): under ``torch.inference_mode``. diffusers' ``__call__`` only disables grad; inference mode also
    skips the autograd bookkeeping each op pays (version counters, view tracking), which a launch-bound eager
    step feels: NucleusMoE's served eager steps (inference mode) ran faster than the same patched pipeline called
    plainly, in one run (benchmarks/results/e2e/NOTES.md, "NucleusMoE at world 1, 2026-12-04").
    Outputs are inference tensors (no autograd), which nothing downstream needs."""
    with torch.inference_mode():
        return pipe(**kwargs)


def call_kwargs(pipe, spec: ModelSpec, *, prompt: str, seed: int = 0, **values) -> dict:
    """`pipeline_kwargs` for one image (or video) of `spec`'s model; None values take the spec's defaults.

    values: negative_prompt, height, width, frames, steps, guidance, true_cfg_scale, images, mask (see
    `request_for`).
    """
    request = request_for(spec, prompt=prompt, seed=seed, **values)
    return pipeline_kwargs(pipe, [request], kind=spec.kind, fixed=fixed_kwargs(spec))


def to_uint8(pixels: np.ndarray) -> np.ndarray:
    """float [0, 1] (any shape ending in channels) -> uint8, rounded half up: the one pixel rule."""
    if pixels.dtype == np.uint8:
        return pixels
    return (np.clip(pixels, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def to_uint8_tensor(pixels: torch.Tensor) -> torch.Tensor:
    """`to_uint8` on a tensor, on its device: the same bytes (float32 clip, * 255, + 0.5, truncate, each its own
    IEEE-rounded op as numpy does them; a bf16 VAE output widens to float32 exactly as diffusers' "np" path)."""
    if pixels.dtype == torch.uint8:
        return pixels
    return pixels.float().clamp(0.0, 1.0).mul(255.0).add(0.5).to(torch.uint8)


def output_pixels(output, kind: str) -> np.ndarray:
    """A pipeline output's pixels as host uint8: (batch, H, W, C) images or (batch, frames, H, W, C) videos.

    output: the pipeline's return value (``.images`` or ``.frames``), made with output_type "pt" (a tensor,
    channels first: (B, C, H, W) / (B, F, C, H, W), rounded on its device, so a GPU hands the host one byte a
    channel instead of a float and the host does no per-pixel work) or "np" (channels last, rounded here).
    Raises ValueError on NaN/inf pixels or a shape that is not (B[, F], H, W, C) with C in 1, 3, 4.
    """
    data = output.frames if kind == "video" else output.images
    want = 5 if kind == "video" else 4
    if isinstance(data, (list, tuple)) and data and isinstance(data[0], torch.Tensor):
        data = torch.stack(list(data))
    if isinstance(data, torch.Tensor):
        if data.ndim != want:
            raise ValueError(f"expected a {kind} tensor of {want} dims (channels first), got shape {tuple(data.shape)}")
        if data.is_floating_point() and not bool(torch.isfinite(data).all()):
            raise ValueError("expected finite pixel values, got NaN or inf from the pipeline")
        last = (0, 2, 3, 1) if kind == "image" else (0, 1, 3, 4, 2)
        pixels = to_uint8_tensor(data).permute(*last).contiguous().cpu().numpy()
    else:
        pixels = np.asarray(data)
        if pixels.ndim == 5 and pixels.shape[2] in (1, 3) and pixels.shape[-1] not in (1, 3):
            pixels = pixels.transpose(0, 1, 3, 4, 2)  # a video pipeline's (B, F, C, H, W) frames
        if pixels.dtype != np.uint8 and not np.isfinite(pixels).all():
            raise ValueError("expected finite pixel values, got NaN or inf from the pipeline")
        pixels = to_uint8(pixels)
    if pixels.ndim != want or pixels.shape[-1] not in (1, 3, 4):  # 4: RGBA (Qwen-Image 2.1's VAE)
        raise ValueError(f"expected {kind} pixels of shape (batch{', frames' if kind == 'video' else ''}, H, W, "
                         f"1|3|4), got {pixels.shape}")
    return pixels


def to_pil_frames(output, kind: str) -> list[Image.Image]:
    """The first sample of a pipeline output (output_type "np" or "pt") as PIL images: one for an image model,
    every frame for video."""
    pixels = output_pixels(output, kind)[0]
    if kind == "image":
        pixels = pixels[None]
    return [Image.fromarray(frame.squeeze(-1) if frame.shape[-1] == 1 else frame) for frame in pixels]


def image_grid(frames: list[Image.Image], columns: int | None = None) -> Image.Image:
    """Frames tiled row by row into one image (``columns`` default: ceil(sqrt(n)))."""
    if not frames:
        raise ValueError("expected at least one frame, got none")
    columns = columns or math.ceil(math.sqrt(len(frames)))
    rows = math.ceil(len(frames) / columns)
    w, h = frames[0].size
    grid = Image.new("RGB", (columns * w, rows * h))
    for i, frame in enumerate(frames):
        grid.paste(frame.convert("RGB"), ((i % columns) * w, (i // columns) * h))
    return grid


def read_mp4(data: bytes) -> np.ndarray:
    """The frames of an MP4 (bytes) as (num_frames, height, width, 3) uint8, through imageio-ffmpeg's ffmpeg:
    what a client of ``/v1/videos`` gets back, decoded (tests, the served benchmark contender)."""
    import os
    import tempfile

    import imageio_ffmpeg

    fd, path = tempfile.mkstemp(suffix=".mp4")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        reader = imageio_ffmpeg.read_frames(path)
        width, height = next(reader)["size"]
        frames = [np.frombuffer(buf, dtype=np.uint8).reshape(height, width, 3) for buf in reader]
    finally:
        os.unlink(path)
    return np.stack(frames)


def save_output(frames: list[Image.Image], path: str | Path, *, kind: str, fps: int = 16) -> Path:
    """Write an image (PNG/JPEG/WebP), a video (MP4) or, for a video to an image suffix, a grid of frames."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in IMAGE_SUFFIXES + VIDEO_SUFFIXES:
        raise ValueError(f"expected an output suffix in {IMAGE_SUFFIXES + VIDEO_SUFFIXES}, got {str(path)!r}")
    if kind == "image" and suffix in VIDEO_SUFFIXES:
        raise ValueError(f"expected an image suffix {IMAGE_SUFFIXES} for an image model, got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix in VIDEO_SUFFIXES:
        # The server's encoder (runtime.mp4): the same bytes as a served MP4 of the same frames.
        path.write_bytes(encode_mp4(np.stack([np.asarray(frame.convert("RGB")) for frame in frames]), fps))
    else:
        image = frames[0] if len(frames) == 1 else image_grid(frames)
        if suffix == ".png":
            # The server's encoder (runtime.png): the same bytes as a served PNG of the same pixels.
            pixels = np.asarray(image)
            path.write_bytes(encode_png(pixels[..., None] if pixels.ndim == 2 else pixels))
        else:
            image.save(path)
    return path
