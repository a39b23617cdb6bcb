"""Run a pipeline with a `ModelSpec`'s defaults and save what it makes (PNG, MP4 or a PNG grid of frames).

Shared by ``xstage-dit generate`` and the server, so both call pipelines and write outputs the same way.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from xstage_dit.models.spec import ModelSpec

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_SUFFIXES = (".mp4",)


def call_kwargs(
    pipe,
    spec: ModelSpec,
    *,
    prompt: str,
    negative_prompt: str | None = None,
    height: int | None = None,
    width: int | None = None,
    frames: int | None = None,
    steps: int | None = None,
    guidance: float | None = None,
    seed: int = 0,
) -> dict:
    """Keyword arguments for ``pipe(**kwargs)``: the spec's defaults where a value is None, validated.

    Raises ValueError naming the bad value (size not a multiple of the patch, steps < 1, ...).
    """
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"expected a non-empty prompt, got {prompt!r}")
    height = spec.height if height is None else int(height)
    width = spec.width if width is None else int(width)
    frames = spec.frames if frames is None else int(frames)
    steps = spec.steps if steps is None else int(steps)
    guidance = spec.guidance if guidance is None else float(guidance)
    spec.check_size(height, width, frames)
    if steps < 1:
        raise ValueError(f"expected steps >= 1, got {steps}")
    if not math.isfinite(guidance) or guidance < 0:
        raise ValueError(f"expected guidance >= 0, got {guidance}")
    device = getattr(pipe, "_execution_device", None) or torch.device("cpu")
    gen_device = "cuda" if torch.device(device).type == "cuda" else "cpu"
    kwargs = dict(
        prompt=prompt,
        height=height,
        width=width,
        num_inference_steps=steps,
        guidance_scale=guidance,
        generator=torch.Generator(gen_device).manual_seed(int(seed)),
        output_type="np",
    )
    params = inspect.signature(pipe.__call__).parameters
    if spec.kind == "video":
        kwargs["num_frames"] = frames
    if negative_prompt is not None and "negative_prompt" in params:
        kwargs["negative_prompt"] = negative_prompt
    if spec.max_sequence_length is not None and "max_sequence_length" in params:
        kwargs["max_sequence_length"] = spec.max_sequence_length
    kwargs.update(spec.call_kwargs)
    unknown = sorted(k for k in kwargs if k not in params)
    if unknown:
        raise ValueError(f"expected arguments of {type(pipe).__name__}.__call__, got {unknown}")
    return kwargs


def to_pil_frames(output, kind: str) -> list[Image.Image]:
    """The first sample of a pipeline output as PIL images: one for an image model, every frame for video."""
    array = output.frames if kind == "video" else output.images
    array = np.asarray(array[0])  # first sample: (H, W, C) or (frames, H, W, C), floats in [0, 1]
    if kind == "image":
        array = array[None]
    if array.ndim != 4 or array.shape[-1] not in (1, 3):
        raise ValueError(f"expected (frames, H, W, C) pixel data, got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError("expected finite pixel values, got NaN or inf from the pipeline")
    pixels = (np.clip(array, 0.0, 1.0) * 255.0).round().astype(np.uint8)
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
        import imageio

        with imageio.get_writer(path, fps=fps, codec="libx264", quality=8, macro_block_size=1) as writer:
            for frame in frames:
                writer.append_data(np.asarray(frame.convert("RGB")))
    elif len(frames) == 1:
        frames[0].save(path)
    else:
        image_grid(frames).save(path)
    return path
