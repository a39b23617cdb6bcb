"""The downloadable assets of a completed video (OpenAI's ``/content?variant=``): the MP4 itself, a thumbnail (its
first frame as a PNG) and a spritesheet (up to `SPRITES` frames evenly spaced through the clip, tiled row by row
into one JPEG, as OpenAI's spritesheets are).

Both images are decoded from the MP4 the client would download (ffmpeg through imageio-ffmpeg, the frames H.264
gives back), on request, off the event loop (`asyncio.to_thread`): one ffmpeg run each, nothing kept.
"""

from __future__ import annotations

import io
import os
import tempfile

import numpy as np
from PIL import Image

from xstage_dit.runtime.generation import image_grid
from xstage_dit.server.media import png_bytes

VARIANTS = ("video", "thumbnail", "spritesheet")
MEDIA_TYPES = {"video": "video/mp4", "thumbnail": "image/png", "spritesheet": "image/jpeg"}
SUFFIXES = {"video": "mp4", "thumbnail": "png", "spritesheet": "jpg"}
SPRITES = 16  # frames in a spritesheet at most (a 4 x 4 grid)


def _frames(mp4: bytes, first_only: bool) -> list[np.ndarray]:
    import imageio_ffmpeg

    fd, path = tempfile.mkstemp(suffix=".mp4")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(mp4)
        reader = imageio_ffmpeg.read_frames(path)
        try:
            width, height = next(reader)["size"]
            frames = []
            for buf in reader:
                frames.append(np.frombuffer(buf, dtype=np.uint8).reshape(height, width, 3))
                if first_only:
                    break
        finally:
            reader.close()  # stops ffmpeg when only the first frame was wanted
    finally:
        os.unlink(path)
    if not frames:
        raise ValueError("expected at least one frame in the MP4, got none")
    return frames


def thumbnail(mp4: bytes) -> bytes:
    """The first frame of `mp4` as PNG bytes."""
    return png_bytes(_frames(mp4, first_only=True)[0])


def spritesheet(mp4: bytes) -> bytes:
    """Up to `SPRITES` frames of `mp4`, evenly spaced (first and last included), tiled into one JPEG."""
    frames = _frames(mp4, first_only=False)
    count = min(SPRITES, len(frames))
    picks = np.unique(np.round(np.linspace(0, len(frames) - 1, count)).astype(int))
    grid = image_grid([Image.fromarray(frames[i]) for i in picks])
    out = io.BytesIO()
    grid.save(out, format="JPEG", quality=90)
    return out.getvalue()


def asset(mp4: bytes, variant: str) -> bytes:
    """The bytes of `variant` ("video", "thumbnail", "spritesheet") of a video whose MP4 is `mp4`."""
    if variant == "video":
        return mp4
    return thumbnail(mp4) if variant == "thumbnail" else spritesheet(mp4)
