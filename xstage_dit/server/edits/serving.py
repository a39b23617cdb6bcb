"""`POST /v1/images/edits`, the handler: read the body (OpenAI's multipart form, or JSON with base64 images), check
its fields and decode its images before anything is queued, then answer as ``/v1/images/generations`` does: JSON
(`images.serving.image_json`), the one PNG, or server-sent events; a client that leaves cancels its job (499)."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from xstage_dit.server.config import ServerConfig
from xstage_dit.server.deps import enqueue, failure, new_job, served
from xstage_dit.server.edits.protocol import MAX_IMAGES, ImageEditRequest, edit_params
from xstage_dit.server.http_layer import error_response, first_validation_error
from xstage_dit.server.image_input import decode_any
from xstage_dit.server.images.serving import DISCONNECT_POLL_S, image_json, png_response
from xstage_dit.server.job_queue import COMPLETED
from xstage_dit.server.protocol import RequestError, check_prompt
from xstage_dit.server.sse import events, sse_response
from xstage_dit.server.worker import Worker

JSON, FORM, URLENCODED = "application/json", "multipart/form-data", "application/x-www-form-urlencoded"
FILE_FIELDS = ("image", "mask")
# A form's fields besides the files: the request model's, each at most a few times (lists are for `image[]`).
MAX_FORM_FIELDS = 64


def _openapi_body() -> dict:
    schema = ImageEditRequest.model_json_schema()
    form = {**schema, "properties": dict(schema.get("properties", {}))}
    form["properties"]["image"] = {"type": "array", "items": {"type": "string", "format": "binary"},
                                   "description": "The image file(s): 1 to 16, as many as the model takes."}
    form["properties"]["mask"] = {"type": "string", "format": "binary", "description": "The mask file."}
    return {"requestBody": {"required": True, "content": {JSON: {"schema": schema}, FORM: {"schema": form}}}}


#: the route's body in the OpenAPI schema: FastAPI cannot infer it from a handler that reads the request itself
OPENAPI_BODY = _openapi_body()


async def _read(request: Request, config: ServerConfig) -> tuple[dict, list, object]:
    """(text fields, images as bytes or base64 strings, the mask or None) of a JSON or multipart body; 415 for
    another media type, 400 for a malformed one, 422 for a file under a text field's name."""
    media = request.headers.get("content-type", JSON).split(";", 1)[0].strip().lower() or JSON
    if media == JSON or (media.startswith("application/") and media.endswith("+json")):
        try:
            fields = json.loads(await request.body())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RequestError("body", f"malformed JSON ({exc})", 400) from None
        if not isinstance(fields, dict):
            raise RequestError("body", f"expected a JSON object, got {type(fields).__name__}")
        images = fields.pop("image", None)
        images = [] if images is None else images if isinstance(images, list) else [images]
        return fields, images, fields.pop("mask", None)
    if media not in (FORM, URLENCODED):  # url-encoded: curl -d, base64 images as text fields
        raise RequestError("content-type", f"expected {FORM} (OpenAI's SDK) or {JSON}, got "
                                           f"{request.headers.get('content-type')!r}", 415)
    try:
        form = await request.form(max_files=MAX_IMAGES + 2, max_fields=MAX_FORM_FIELDS,
                                  max_part_size=config.max_upload_bytes)
    except Exception as exc:  # noqa: BLE001 - the multipart parser's own errors (malformed, too many parts)
        raise RequestError("body", f"malformed multipart/form-data ({getattr(exc, 'detail', exc)})", 400) from None
    try:
        fields: dict = {}
        images, mask = [], None
        for raw, value in form.multi_items():
            name = raw[:-2] if raw.endswith("[]") else raw
            data = await value.read() if isinstance(value, UploadFile) else value
            if name == "image":
                images.append(data)
            elif name == "mask":
                mask = data
            elif name == "markup":  # refused by the protocol, with its reason
                fields["markup"] = "(a file)"
            elif isinstance(value, UploadFile):
                raise RequestError(name, f"expected a text field, got a file upload (files go in {', '.join(FILE_FIELDS)})")
            elif name in fields:
                fields[name] = [*fields[name], value] if isinstance(fields[name], list) else [fields[name], value]
            else:
                fields[name] = value
        return fields, images, mask
    finally:
        await form.close()


def _parse(fields: dict) -> ImageEditRequest:
    """`fields` as the request model: the first problem named as the JSON endpoints name it (422)."""
    try:
        return ImageEditRequest.model_validate(fields)
    except ValidationError as exc:
        errors = [{**err, "loc": ("body", *err.get("loc", ()))} for err in exc.errors()]
        status, param, message = first_validation_error(RequestValidationError(errors))
        raise RequestError(param, message.removeprefix(f"{param}: "), status) from None


async def edit(request: Request, worker: Worker, config: ServerConfig) -> Response:
    """Queue the edits of the request as one job and answer it (as ``/v1/images/generations``). The model, the
    prompt and every field are checked, then each image decoded (`image_input.decode_any`: its size from the header
    first), before anything is queued."""
    fields, raw_images, raw_mask = await _read(request, config)
    req = _parse(fields)
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
    job = new_job(config, edit_params(req, images, mask, model, config))
    q = job.subscribe(progress=req.stream)  # before it is queued: no step happens before the client listens
    enqueue(worker, job)
    if req.stream:
        return sse_response(events(worker, job, lambda j: image_json(worker, j), cancel_on_disconnect=True, q=q),
                            job)
    try:  # as images.serving.generate: wait, checking on a clock whether the client left
        next_check = time.monotonic() + DISCONNECT_POLL_S
        while not job.done:
            try:
                await asyncio.wait_for(q.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                pass
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    worker.queue.cancel(job.id)
                    worker.metrics.errors.labels("client_disconnected").inc()
                    return error_response(499, "client disconnected")
    finally:
        job.unsubscribe(q)
    if job.status != COMPLETED:
        return failure(job)
    if req.response_format == "png":
        return png_response(job)
    return Response(image_json(worker, job), media_type="application/json", headers={"X-Job-Id": job.id})
