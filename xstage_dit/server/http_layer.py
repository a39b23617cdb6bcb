"""HTTP plumbing of the app: the one error shape and every handler that produces it (validation, the
project's `RequestError`, Starlette's own 404/405, 415 for a body that is not JSON), the mapping of
pydantic errors to "expected X, got Y" naming the field, and two pure-ASGI middlewares (body size limit,
request counting) that leave the client's disconnect visible to the handlers (which
BaseHTTPMiddleware would hide)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from xstage_dit.server.protocol import RequestError

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "method_not_allowed", 409: "conflict_error", 413: "request_too_large",
                415: "unsupported_media_type", 422: "invalid_request_error", 429: "rate_limit_error",
                499: "cancelled", 500: "server_error", 503: "service_unavailable", 504: "timeout_error",
                507: "insufficient_storage"}

#: How much of a refused body the server reads (and throws away) before it answers 413. A client that
#: writes its whole body before reading (Python's urllib, many scripts) sees a reset connection instead
#: of the 413 when the server closes on unread data, so the rest is drained, in 64 KiB pieces (never
#: held whole), up to these bounds; past them the answer is sent with `Connection: close`.
DRAIN_MAX_BYTES = 1 << 30
DRAIN_MAX_S = 30.0
#: A client that stops sending for this long while being drained is answered at once.
DRAIN_IDLE_S = 2.0


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None) -> JSONResponse:
    """`{"error": {"message", "type", "param", "code"}}` with `status`: the only error body of the API. extra:
    keys beside "error" (a 409 cancel carries the job's state)."""
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "error"), "param": param, "code": status},
            **(extra or {})}
    return JSONResponse(body, status_code=status, headers=headers)


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int, drained: bool):
        super().__init__(413, f"body: expected at most {limit} bytes, got more",
                         headers=None if drained else {"Connection": "close"})


async def drain(receive, max_bytes: int = DRAIN_MAX_BYTES, max_s: float = DRAIN_MAX_S,
                idle_s: float = DRAIN_IDLE_S) -> bool:
    """Read and discard the rest of a request body. True when it ended within the bounds (the
    connection can then be answered and kept); False when the client stalled, left, or sent too much."""
    drained, deadline = 0, time.monotonic() + max_s
    while drained <= max_bytes:
        wait = min(idle_s, deadline - time.monotonic())
        if wait <= 0:
            return False
        try:
            message = await asyncio.wait_for(receive(), wait)
        except asyncio.TimeoutError:
            return False
        if message["type"] != "http.request":  # http.disconnect
            return False
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return True
    return False


class BodyLimitMiddleware:
    """Refuses bodies over `max_bytes` with 413: by Content-Length up front, else while reading. Either
    way the rest of the body is drained first (see `DRAIN_MAX_BYTES`), except for a client that sent
    `Expect: 100-continue`: it waits for the answer before sending, so it gets the 413 at once.
    uploads: path -> its own limit (the endpoints that take image files)."""

    def __init__(self, app: Any, max_bytes: int, uploads: dict[str, int] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.uploads = dict(uploads or {})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.uploads.get(scope.get("path", ""), self.max_bytes)
        if limit != self.max_bytes:
            return await BodyLimitMiddleware(self.app, limit)(scope, receive, send)
        headers = dict(scope.get("headers", []))
        value = headers.get(b"content-length")
        if value is not None:
            try:
                length = int(value)
            except ValueError:
                length = -1
            if length > self.max_bytes or length < 0:
                waiting = headers.get(b"expect", b"").lower() == b"100-continue"
                drained = not waiting and await drain(receive)
                response = error_response(413, f"body: expected at most {self.max_bytes} bytes, got "
                                          f"Content-Length {value.decode('latin-1')}", "body",
                                          None if drained else {"Connection": "close"})
                return await response(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    drained = not message.get("more_body", False) or await drain(receive)
                    raise BodyTooLarge(self.max_bytes, drained)
            return message

        await self.app(scope, limited_receive, send)


class RequestCountMiddleware:
    """Counts responses by route template and status (pure ASGI: keeps disconnect detection intact)."""

    def __init__(self, app: Any, metrics: Any):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            route = scope.get("route")
            self.metrics.requests.labels(getattr(route, "path", "unmatched"), str(status[0])).inc()


# pydantic error type -> what the field expects, said the project's way ("expected X, got Y").
_EXPECTED = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "string_type": "a string", "bool_type": "true or false", "bool_parsing": "true or false",
    "dict_type": "a JSON object", "list_type": "a JSON array",
}


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def first_validation_error(exc: RequestValidationError) -> tuple[int, str, str]:
    """(status, param, message) for the first pydantic error, naming the field."""
    err = exc.errors()[0]
    where = err.get("loc", ())
    loc = [str(p) for p in where[1:]] if where and where[0] in ("body", "query", "path") else [str(p) for p in where]
    kind = err.get("type", "")
    if kind == "json_invalid":
        reason = (err.get("ctx") or {}).get("error", "invalid JSON")
        return 400, "body", f"body: malformed JSON ({reason})"
    if kind == "extra_forbidden":
        return 422, loc[-1] if loc else "body", f"{'.'.join(loc)}: unknown field"
    param = ".".join(loc) or "body"
    if kind == "missing":
        return 422, param, f"{param}: field required"
    if kind == "model_attributes_type" or (not loc and "dict" in err.get("msg", "")):
        return 422, "body", "body: expected a JSON object"
    given = err.get("input")
    given_text = "a JSON object" if isinstance(given, dict) else "a JSON array" if isinstance(given, list) else (
        "null" if given is None else repr(given))
    if kind in _EXPECTED:
        return 422, param, f"{param}: expected {_EXPECTED[kind]}, got {given_text}"
    if kind == "literal_error":
        return 422, param, f"{param}: expected {(err.get('ctx') or {}).get('expected', 'an allowed value')}, got {given_text}"
    message = err.get("msg", "invalid value")
    return 422, param, message if "got" in message else f"{param}: {message}, got {given_text}"


def install_error_handlers(app: FastAPI, metrics: Any) -> None:
    """Every error the app can answer, in the one envelope: validation (422, 400 for malformed JSON,
    415 for a body sent as another media type), `RequestError`, and every HTTPException, including
    Starlette's own 404 (no such route) and 405 (method not allowed)."""

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        metrics.errors.labels("validation").inc()
        content_type = request.headers.get("content-type")
        first = exc.errors()[0].get("loc", ())
        if content_type and not _is_json(content_type) and first and first[0] == "body":
            return error_response(415, f"content-type: expected application/json, got {content_type!r}",
                                  "content-type")
        status, param, message = first_validation_error(exc)
        return error_response(status, message, param)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        metrics.errors.labels("validation").inc()
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 404 and exc.detail == "Not Found":  # Starlette's router: no such path
            return error_response(404, f"path: no route {request.url.path!r} (see /docs)", "path", headers)
        if exc.status_code == 405:
            allowed = headers.get("allow") or headers.get("Allow") or ""
            return error_response(405, f"method: expected {allowed or 'another method'} for "
                                  f"{request.url.path!r}, got {request.method}", "method", headers)
        param = "body" if exc.status_code == 413 else None
        return error_response(exc.status_code, str(exc.detail), param, headers or None)
