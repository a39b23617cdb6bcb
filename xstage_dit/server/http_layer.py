"""HTTP plumbing of the app: the one error shape, the mapping of pydantic errors to a message naming
the field, and two pure-ASGI middlewares (body size limit, request counting) that leave the client's
disconnect visible to the handlers (which BaseHTTPMiddleware would hide)."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                409: "conflict_error", 413: "request_too_large", 422: "invalid_request_error",
                429: "rate_limit_error", 499: "cancelled", 500: "server_error", 503: "service_unavailable",
                504: "timeout_error"}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "error"), "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"body: expected at most {limit} bytes, got more")


class BodyLimitMiddleware:
    """Refuses bodies over `max_bytes` (413): by Content-Length up front, else while reading."""

    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = -1
                if length > self.max_bytes or length < 0:
                    response = error_response(413, f"body: expected at most {self.max_bytes} bytes, got "
                                              f"Content-Length {value.decode('latin-1')}", "body")
                    return await response(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
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


def first_validation_error(exc: RequestValidationError) -> tuple[int, str, str]:
    """(status, param, message) for the first pydantic error, naming the field."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
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
    given_text = "" if isinstance(given, (dict, list)) else f", got {given!r}"
    return 422, param, f"{param}: {err.get('msg', 'invalid value')}{given_text}"
