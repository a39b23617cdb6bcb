"""The HTTP app of rank 0: middlewares, the error handlers and the routers of `xstage_dit.server.routes`
(images, videos, jobs, health + metrics, models + calibration, the web page at `/`).

The app only talks to a `Worker` (rank 0's side of the multi-rank worker) and its `JobQueue`; it never
touches the pipeline. Errors always have the shape `{"error": {"message", "type", "param", "code"}}`,
and the message names the offending field.
"""

from __future__ import annotations

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError

from xstage_dit.server.config import ServerConfig
from xstage_dit.server.http_layer import BodyLimitMiddleware, RequestCountMiddleware, error_response, first_validation_error
from xstage_dit.server.routes import ROUTERS
from xstage_dit.server.schemas import ErrorResponse, RequestError
from xstage_dit.server.worker import Worker


def create_app(worker: Worker, config: ServerConfig | None = None) -> FastAPI:
    """The HTTP app of rank 0. `worker` must be started (`worker.start()`) by the caller."""
    config = config or worker.config
    metrics = worker.metrics
    app = FastAPI(title="xstage_dit server", version="0.1.0",
                  description="Image and video generation with diffusers DiT pipelines over several GPUs.",
                  responses={400: {"model": ErrorResponse}, 422: {"model": ErrorResponse}})
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    app.add_middleware(RequestCountMiddleware, metrics=metrics)
    app.state.worker = worker
    app.state.config = config

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        status, param, message = first_validation_error(exc)
        metrics.errors.labels("validation").inc()
        return error_response(status, message, param)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        metrics.errors.labels("validation").inc()
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, exc: HTTPException):
        param = "body" if exc.status_code == 413 else None
        return error_response(exc.status_code, str(exc.detail), param, getattr(exc, "headers", None))

    for router in ROUTERS:
        app.include_router(router)
    return app
