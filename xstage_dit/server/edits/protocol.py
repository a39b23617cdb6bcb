"""`POST /v1/images/edits`: the request model and `edit_params`, which checks a request (its fields and its decoded
images) against the served model and the server's limits and turns it into the job's items, one per image, each
carrying the input images (`GenerationRequest.inputs`).

The fields are those of ``/v1/images/generations`` (`ImageEditRequest` extends its request model, so an OpenAI field
honoured or refused there is the same here) and OpenAI's edit fields: ``image`` (1..16; the served pipeline's own
count is checked), ``mask`` (white or, with an alpha channel, transparent = repaint; the first image's size),
``markup`` and ``input_fidelity`` (refused, with the reason). ``size`` omitted or ``auto``: the first image's size,
rounded down to the model's multiple, where the pipeline sizes its output after its input (the edit pipelines),
else the model's default.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from pydantic import Field
from PIL import Image

from xstage_dit.runtime.conditioning import default_size
from xstage_dit.server.config import ServedModel, ServerConfig
from xstage_dit.server.image_input import checked_inputs
from xstage_dit.server.images.protocol import ImageGenerationRequest, ImageJobSpec, image_params
from xstage_dit.server.protocol import RequestError

#: OpenAI's edits API takes up to 16 images; the served pipeline's own count is checked after
MAX_IMAGES = 16


class ImageEditRequest(ImageGenerationRequest):
    """`POST /v1/images/edits`: the generation fields plus the input images. Multipart (OpenAI's SDK): ``image``
    (or ``image[]``) files and a ``mask`` file; JSON: the same as base64 strings or ``data:`` URLs."""

    image: str | list[str] | None = Field(
        None, description="JSON: the input image(s), base64 or data: URLs (multipart: files named image or image[]); "
                          "1 to 16, as many as the model takes.")
    mask: str | None = Field(None, description="JSON: the mask, base64 or a data: URL (multipart: a file): white, or "
                                               "with an alpha channel transparent, = repaint; the first image's size.")
    input_fidelity: Literal["high", "low"] | None = Field(
        None, description="Refused: no fidelity control (the pipeline's conditioning decides how closely it follows "
                          "the input).")
    markup: str | None = Field(None, description="Refused: no markup overlay (use mask).")


def _refuse_unsupported(req: ImageEditRequest) -> None:
    if req.input_fidelity is not None:
        raise RequestError("input_fidelity", f"{req.input_fidelity!r} is not supported: the pipeline has no fidelity "
                                             "control (its image conditioning decides how closely the output follows "
                                             "the input); omit it", 400)
    if req.markup is not None:
        raise RequestError("markup", "not supported: no markup overlay; use mask to say where to repaint", 400)


def edit_params(req: ImageEditRequest, images: list[Image.Image], mask: Image.Image | None, served: ServedModel,
                config: ServerConfig) -> ImageJobSpec:
    """The checked job: `image_params` of the generation fields (one item per image, seeds seed, seed+1, ...), each
    item carrying the checked input images; `RequestError` naming the first bad or refused field."""
    _refuse_unsupported(req)
    if not 1 <= len(images) <= MAX_IMAGES:
        raise RequestError("image", f"expected 1 to {MAX_IMAGES} images, got {len(images)}")
    inputs = checked_inputs(served, images, mask)
    size = req.size
    if size is None or size.strip().lower() == "auto":
        auto = default_size(served.image_inputs, inputs, served.size_multiple)
        size = None if auto is None else f"{auto[0]}x{auto[1]}"
    try:
        spec = image_params(req.model_copy(update={"size": size, "image": None, "mask": None}), served, config)
    except RequestError as exc:
        if exc.param == "size" and req.size in (None, "auto"):  # the size came from the input image
            raise RequestError("size", f"{exc.message.removeprefix('size: ')} (size auto: the input image's "
                                       f"{size}); pass a size") from None
        raise
    return replace(spec, items=[replace(item, inputs=inputs) for item in spec.items])
