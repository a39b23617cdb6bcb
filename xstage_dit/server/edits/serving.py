"""`POST /v1/images/edits`, the handler: read the body (OpenAI's multipart form, or JSON with base64 images), check
its fields and decode its images before anything is queued, then answer as ``/v1/images/generations`` does
(`images.serving.answer`): JSON, the one PNG, or OpenAI's server-sent events (``image_edit.*``); a client that
leaves cancels its job (499)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from xstage_dit.server.config import ServerConfig
from xstage_dit.server.deps import served
from xstage_dit.server.edits.protocol import MAX_IMAGES, ImageEditRequest, edit_params
from xstage_dit.server.image_input import decode_any
from xstage_dit.server.images.serving import answer
from xstage_dit.server.protocol import RequestError, check_prompt
from xstage_dit.server.request_body import Body, openapi_body, parse_as, read_body
from xstage_dit.server.worker import Worker

FILE_FIELDS = ("image", "mask", "markup")
EDIT = "image_edit"  # the OpenAI event family of an edit's stream

#: the route's body in the OpenAPI schema: FastAPI cannot infer it from a handler that reads the request itself
OPENAPI_BODY = openapi_body(ImageEditRequest, ("image", "mask"))


def _inputs(body: Body) -> tuple[list, object]:
    """(images as bytes or base64 strings, the mask or None) of the body: files in a form, strings in JSON (or in a
    url-encoded form); a markup file becomes the field the protocol refuses with its reason."""
    fields, files = body.fields, body.files
    if files.pop("markup", None):
        fields["markup"] = "(a file)"
    images = [f.data for f in files.get("image", [])]
    text = fields.pop("image", None)
    images += [] if text is None else text if isinstance(text, list) else [text]
    masks = [f.data for f in files.get("mask", [])]
    if fields.get("mask") is not None:
        masks.append(fields.pop("mask"))
    if len(masks) > 1:
        raise RequestError("mask", f"expected one mask, got {len(masks)}")
    return images, masks[0] if masks else None


async def edit(request: Request, worker: Worker, config: ServerConfig) -> Response:
    """Queue the edits of the request as one job and answer it (as ``/v1/images/generations``). The model, the
    prompt and every field are checked, then each image decoded (`image_input.decode_any`: its size from the header
    first), before anything is queued."""
    body = await read_body(request, file_fields=FILE_FIELDS)
    raw_images, raw_mask = _inputs(body)
    req = parse_as(ImageEditRequest, body.fields)
    model = served(worker)
    check_prompt(req.prompt, "prompt", config, required=True)
    if model.kind != "image":
        raise RequestError("model", f"expected an image model for this endpoint, got {model.name!r} which generates "
                                    f"videos: use POST /v1/videos with input_reference", 400)
    if not raw_images:
        raise RequestError("image", "field required: 1 to 16 image files (or base64 strings in JSON)")
    if len(raw_images) > MAX_IMAGES:
        raise RequestError("image", f"expected 1 to {MAX_IMAGES} images, got {len(raw_images)}")
    images = [decode_any(value, "image", config.max_image_pixels) for value in raw_images]
    mask = None if raw_mask is None else decode_any(raw_mask, "mask", config.max_image_pixels)
    return await answer(edit_params(req, images, mask, model, config), req, request, worker, config, EDIT)
