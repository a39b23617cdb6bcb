"""Input images of HTTP requests (``/v1/images/edits``, ``input_reference`` of ``/v1/videos``): one decoder with the
bad-input rules, and the checks against the served model, each a 4xx naming the field before anything is queued.

- not an image (or not PNG / JPEG / WebP), a truncated or corrupt file, bad base64: 400;
- more pixels than ``--max-image-pixels``: 422, read from the file's header before any pixel is decoded (a
  decompression bomb stays compressed);
- a model that takes no image: 400; fewer or more images than it takes, a mask it does not take or whose size is
  not the first image's: 422 (`runtime.conditioning.InputImages.of`, the one rule ``generate`` uses too).

Example::

    image = decode_image(upload_bytes, "image", config.max_image_pixels)
    inputs = checked_inputs(served, [image], mask=None)                  # InputImages for the request's items
    inputs = reference_inputs(req.input_reference, served, config)       # a video's reference (bytes, base64, dict)
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError

from xstage_dit.runtime.conditioning import ImageInputError, InputImages, refuse_untaken
from xstage_dit.server.config import ServedModel, ServerConfig
from xstage_dit.server.protocol import RequestError

FORMATS = ("PNG", "JPEG", "WEBP")
_DATA_URL = re.compile(r"^data:image/[\w.+-]+;base64,", re.IGNORECASE)
_PIXELS = re.compile(r"\((\d+) pixels\)")


def decode_image(data: bytes, param: str, max_pixels: int) -> Image.Image:
    """`data` (an uploaded file's bytes) as a decoded PIL image, EXIF orientation applied; `RequestError` naming
    `param`: 400 for anything that is not a whole PNG, JPEG or WebP, 422 above `max_pixels` (from the header)."""
    if not data:
        raise RequestError(param, "expected a PNG, JPEG or WebP image, got an empty file", 400)
    try:
        image = Image.open(io.BytesIO(data))  # the header only: no pixel is decoded yet
    except Image.DecompressionBombError as exc:  # Pillow's own header check (twice its MAX_IMAGE_PIXELS)
        found = _PIXELS.search(str(exc))
        raise RequestError(param, f"expected at most {max_pixels} pixels (--max-image-pixels), got "
                                  f"{found.group(1) if found else 'more'} (refused before decoding)") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise RequestError(param, f"expected a PNG, JPEG or WebP image, got {len(data)} bytes no image decoder reads "
                                  f"(starting {data[:8]!r})", 400) from None
    if image.format not in FORMATS:
        raise RequestError(param, f"expected a PNG, JPEG or WebP image, got {image.format}", 400)
    width, height = image.size
    if width * height > max_pixels:
        raise RequestError(param, f"expected at most {max_pixels} pixels (--max-image-pixels), got {width}x{height} "
                                  f"(refused before decoding)")
    try:
        image.load()
        return ImageOps.exif_transpose(image)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise RequestError(param, f"expected a complete {image.format} image, got a truncated or corrupt one ({exc})",
                           400) from None


def decode_base64_image(text: str, param: str, max_pixels: int) -> Image.Image:
    """A JSON body's image: base64 of the file, or a ``data:image/...;base64,`` URL; `decode_image` after."""
    if not isinstance(text, str):
        raise RequestError(param, f"expected base64 image data (or a data: URL), got {type(text).__name__}")
    if text.startswith(("http://", "https://")):
        raise RequestError(param, "expected the image itself (base64 or a data: URL), got a URL: this server "
                                  "downloads nothing", 400)
    payload = _DATA_URL.sub("", text.strip(), count=1)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        shown = text[:32] + ("..." if len(text) > 32 else "")
        raise RequestError(param, f"expected base64 image data (or a data: URL), got {shown!r}", 400) from None
    return decode_image(data, param, max_pixels)


def decode_any(value: Any, param: str, max_pixels: int) -> Image.Image:
    """An uploaded file's bytes, a base64 string / data URL, or OpenAI's reference object ``{"image_url": data
    URL}`` (``{"file_id"}`` refused: no file store here)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return decode_image(bytes(value), param, max_pixels)
    if isinstance(value, dict):
        if "file_id" in value:
            raise RequestError(param, "expected the image (a file upload, base64 or {\"image_url\": a data: URL}), "
                                      "got a file_id: this server keeps no file store", 400)
        if set(value) != {"image_url"}:
            raise RequestError(param, f"expected {{\"image_url\": a data: URL}}, got the keys {sorted(value)}")
        value = value["image_url"]
    return decode_base64_image(value, param, max_pixels)


def checked_inputs(served: ServedModel, images: list[Image.Image], mask: Image.Image | None = None, *,
                   image_param: str = "image", mask_param: str = "mask") -> InputImages | None:
    """`images` and `mask` checked against how the served pipeline takes them (`InputImages.of`): 400 when it
    takes none, 422 for a count or a mask it cannot take, each naming `image_param` / `mask_param`."""
    try:
        return InputImages.of(served.image_inputs, images, mask, model=served.name)
    except ImageInputError as exc:
        param = mask_param if exc.param == "mask" else image_param
        raise RequestError(param, exc.detail, 400 if served.image_inputs is None else 422) from None


def reference_inputs(value: Any, served: ServedModel, config: ServerConfig,
                     param: str = "input_reference") -> InputImages | None:
    """A video request's ``input_reference`` (an uploaded file's bytes, base64 / a data URL, or ``{"image_url":
    ...}``; a list of them, in order; None when absent) as the request's `InputImages`: the first frame of an
    image-to-video model (and the last of a first-last-frame one). A text-to-video model given any (refused before
    their bytes are decoded), or an image-to-video model given fewer or more than it takes: 4xx naming `param`."""
    values = [] if value is None else list(value) if isinstance(value, list) else [value]
    if values and served.image_inputs is None:
        try:
            refuse_untaken(len(values), False, served.name)
        except ImageInputError as exc:
            raise RequestError(param, exc.detail, 400) from None
    images = [decode_any(v, param, config.max_image_pixels) for v in values]
    return checked_inputs(served, images, image_param=param)


def check_text_only(served: ServedModel) -> None:
    """``/v1/images/generations`` on a model that needs input images: 400 pointing at ``/v1/images/edits``."""
    facts = served.image_inputs
    if facts is not None and facts.min_images:
        raise RequestError("model", f"expected a model that generates from text alone for this endpoint, got "
                                    f"{served.name!r}, which edits input images: use POST /v1/images/edits", 400)
