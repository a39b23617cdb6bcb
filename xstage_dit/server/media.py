"""Encoding generated pixels for HTTP: PNG (or the JPEG / WebP a request asks for, `ImageEncoding`) for
images, MP4 (H.264, yuv420p) for videos.

Arrays come from the pipeline as floats in [0, 1]; `xstage_dit.runtime.generation.to_uint8` rounds them once,
the same way for every image and for `xstage-dit generate`, so an image's bytes depend only on its pixels (and,
for JPEG / WebP, on the encoder's quality).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from xstage_dit.runtime.generation import to_uint8
from xstage_dit.runtime.mp4 import encode_mp4
from xstage_dit.runtime.png import encode_png


IMAGE_FORMATS = ("png", "jpeg", "webp")
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


@dataclass(frozen=True)
class ImageEncoding:
    """How one request's images are encoded (OpenAI's ``output_format`` / ``output_compression`` / ``background``).

    format: "png" (`runtime.png`, lossless, the default), "jpeg" or "webp" (Pillow, lossy).
    quality: JPEG / WebP quality 0..100 (Pillow's ``quality``; 100 = the least loss), None for PNG.
    opaque: drop an alpha channel (a model whose VAE makes RGBA, Qwen-Image 2.1); JPEG always drops it.
    """

    format: str = "png"
    quality: int | None = None
    opaque: bool = False

    def __post_init__(self) -> None:
        if self.format not in IMAGE_FORMATS:
            raise ValueError(f"expected an image format in {IMAGE_FORMATS}, got {self.format!r}")
        if (self.quality is None) != (self.format == "png") or not (self.quality is None or 0 <= self.quality <= 100):
            raise ValueError(f"expected a quality in [0, 100] for jpeg/webp and None for png, got {self.quality!r} "
                             f"for {self.format}")

    @property
    def media_type(self) -> str:
        return MEDIA_TYPES[self.format]


def has_alpha(image: np.ndarray, encoding: ImageEncoding | None) -> bool:
    """Whether `image` (H, W, C) keeps an alpha channel once encoded with `encoding`."""
    enc = encoding or ImageEncoding()
    return image.shape[-1] in (2, 4) and not enc.opaque and enc.format != "jpeg"


def image_bytes(image: np.ndarray, encoding: ImageEncoding | None = None) -> bytes:
    """image: (height, width, 1|3|4) float in [0, 1] or uint8 -> its bytes in `encoding` (default PNG)."""
    enc = encoding or ImageEncoding()
    if not has_alpha(image, enc) and image.ndim == 3 and image.shape[-1] == 4:
        image = image[..., :3]
    if enc.format == "png":
        return png_bytes(image)
    from PIL import Image

    pixels = to_uint8(image)
    out = io.BytesIO()
    Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels).save(
        out, format=enc.format.upper(), quality=enc.quality)
    return out.getvalue()


def png_bytes(image: np.ndarray) -> bytes:
    """image: (height, width, 1|3|4) float in [0, 1] or uint8 -> PNG bytes (`runtime.png.encode_png`)."""
    if image.ndim != 3 or image.shape[-1] not in (1, 3, 4):
        raise ValueError(f"expected an image of shape (height, width, 1|3|4), got {tuple(image.shape)}")
    return encode_png(to_uint8(image))


def mp4_bytes(frames: np.ndarray, fps: int) -> bytes:
    """frames: (num_frames, height, width, 3) float in [0, 1] or uint8 -> H.264 MP4 bytes (`runtime.mp4`)."""
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected frames of shape (num_frames, height, width, 3), got {tuple(frames.shape)}")
    return encode_mp4(to_uint8(frames), fps)


def encode_batch(pixels: np.ndarray, items, encodings=None) -> list[bytes]:
    """A batch's outputs for HTTP: one image per image item (PNG, or its job's `ImageEncoding`), or one MP4 per
    video at its item's fps.

    pixels: (n, H, W, C) images or (n, frames, H, W, 3) videos, uint8 or floats in [0, 1]; items: the batch's
    n `GenerationRequest` items, in the same order; encodings: n `ImageEncoding` or None (PNG), or None."""
    if items[0].kind == "video":
        return [mp4_bytes(frames, item.fps) for frames, item in zip(pixels, items)]
    encodings = encodings or [None] * len(pixels)
    return [image_bytes(image, enc) for image, enc in zip(pixels, encodings)]
