"""Encoding generated pixels for HTTP: PNG for images, MP4 (H.264, yuv420p) for videos.

Arrays come from the pipeline as floats in [0, 1]; `xstage_dit.runtime.generation.to_uint8` rounds them once,
the same way for every image and for `xstage-dit generate`, so an image's bytes depend only on its pixels.
"""

from __future__ import annotations

import numpy as np

from xstage_dit.runtime.generation import to_uint8
from xstage_dit.runtime.mp4 import encode_mp4
from xstage_dit.runtime.png import encode_png


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


def encode_batch(pixels: np.ndarray, items) -> list[bytes]:
    """A batch's outputs for HTTP: one PNG per image, or one MP4 per video at its item's fps.

    pixels: (n, H, W, C) images or (n, frames, H, W, 3) videos, uint8 or floats in [0, 1]; items: the batch's
    n `GenerationRequest` items, in the same order."""
    if items[0].kind == "video":
        return [mp4_bytes(frames, item.fps) for frames, item in zip(pixels, items)]
    return [png_bytes(image) for image in pixels]
