"""Request bodies that come as JSON or as multipart/form-data: what OpenAI's SDK sends for ``POST /v1/videos``
(``videos.create``: multipart, with ``input_reference`` as an optional file) and ``POST /v1/images/edits``
(``image`` files and ``mask``). One reader for every such endpoint:

    body = await read_body(request, file_fields=("input_reference",))   # JSON or multipart, checked
    req = parse_as(VideoCreateRequest, body.fields)                       # 422 naming the field, as for JSON
    files = body.files.get("input_reference", [])                         # [UploadedFile(name, type, data)]

A form's text fields become the model's fields (pydantic converts "4" for an integer field as for any lax
input); a repeated name, or a name ending in ``[]`` (the SDK's lists), becomes a list. A file part is allowed only
under `file_fields` (its bytes read at once, bounded by the app's body limit); a text part under a file field (a
URL or base64 string, as JSON would carry it) stays a field. `openapi_body` documents both media types for the
route (FastAPI cannot infer them from a handler that reads the request itself).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from xstage_dit.server.http_layer import first_validation_error
from xstage_dit.server.protocol import RequestError

JSON, FORM, URLENCODED = "application/json", "multipart/form-data", "application/x-www-form-urlencoded"
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class UploadedFile:
    """One file part of a multipart body: its form name, filename, content type and bytes."""

    name: str
    filename: str | None
    content_type: str | None
    data: bytes


@dataclass
class Body:
    """fields: the JSON object (or the form's text fields); files: form name -> its uploaded files, in order."""

    fields: dict[str, Any]
    files: dict[str, list[UploadedFile]] = field(default_factory=dict)
    media_type: str = JSON


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", JSON).split(";", 1)[0].strip().lower() or JSON


def _is_json(media: str) -> bool:
    return media == JSON or (media.startswith("application/") and media.endswith("+json"))


async def read_body(request: Request, *, file_fields: tuple[str, ...] = ()) -> Body:
    """The body of `request` as JSON (an object) or a form (multipart/form-data, or url-encoded as ``curl -d``
    sends one); 415 for any other media type, 400 for a malformed one, 422 for a file part outside
    `file_fields`."""
    media = _media_type(request)
    if _is_json(media):
        raw = await request.body()
        try:
            fields = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RequestError("body", f"malformed JSON ({exc})", 400) from None
        if not isinstance(fields, dict):
            raise RequestError("body", "expected a JSON object")
        return Body(fields, {}, JSON)
    if media not in (FORM, URLENCODED):
        raise RequestError("content-type", f"expected {JSON} or {FORM}, got {request.headers.get('content-type')!r}",
                           415)
    try:
        form = await request.form()
    except StarletteHTTPException as exc:  # the multipart parser's own 400
        raise RequestError("body", f"malformed multipart/form-data ({exc.detail})", exc.status_code) from None
    try:
        return await _split_form(form, file_fields)
    finally:
        await form.close()


async def _split_form(form, file_fields: tuple[str, ...]) -> Body:
    fields: dict[str, Any] = {}
    files: dict[str, list[UploadedFile]] = {}
    lists = set()
    for raw_name, value in form.multi_items():
        name = raw_name[:-2] if raw_name.endswith("[]") else raw_name
        if isinstance(value, UploadFile):
            if name not in file_fields:
                raise RequestError(name, "expected a text field, got a file upload" + (
                    f" (files go in {', '.join(file_fields)})" if file_fields else ""))
            files.setdefault(name, []).append(UploadedFile(name, value.filename, value.content_type,
                                                           await value.read()))
            continue
        if name in fields or raw_name.endswith("[]"):
            if name not in lists:
                fields[name] = [] if name not in fields else [fields[name]]
                lists.add(name)
            fields[name].append(value)
        else:
            fields[name] = value
    return Body(fields, files, FORM)  # url-encoded or multipart: the same fields


def parse_as(model: type[M], fields: dict[str, Any]) -> M:
    """`fields` validated as `model`; a `RequestError` like the app's JSON validation errors (the first problem,
    naming its field: "expected X, got Y", unknown fields 422)."""
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        errors = [{**err, "loc": ("body", *err.get("loc", ()))} for err in exc.errors()]
        status, param, message = first_validation_error(RequestValidationError(errors))
        raise RequestError(param, message, status, named=True) from None


def openapi_body(model: type[BaseModel], file_fields: tuple[str, ...] = ()) -> dict:
    """The route's ``openapi_extra``: its body as JSON (`model`'s schema) or multipart/form-data (the same
    fields, `file_fields` also as binary files)."""
    schema = model.model_json_schema()
    form = {**schema, "properties": dict(schema.get("properties", {}))}
    for name in file_fields:
        form["properties"][name] = {"type": "string", "format": "binary",
                                    "description": schema["properties"].get(name, {}).get("description", "")}
    return {"requestBody": {"required": True, "content": {JSON: {"schema": schema}, FORM: {"schema": form}}}}
