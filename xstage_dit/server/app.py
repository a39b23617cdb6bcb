"""The HTTP app of rank 0: middlewares, the error handlers and one router per endpoint (`ROUTERS`: the web
page at `/`, health + metrics, models + calibration, images, image edits, videos, jobs, LoRA adapters). Each endpoint is a package of
`xstage_dit.server`: its `router` (the routes), `protocol` (pydantic request and response models) and
`serving` (the handler), after vLLM's entrypoints.

The app only talks to a `Worker` (rank 0's side of the multi-rank worker) and its `JobQueue`; it never
touches the pipeline. Errors always have the shape `{"error": {"message", "type", "param", "code"}}`,
and the message names the offending field.
"""

from __future__ import annotations

from fastapi import FastAPI

from xstage_dit import __version__
from xstage_dit.server.config import UPLOAD_PATHS, ServerConfig
from xstage_dit.server.assets import install_offline_docs
from xstage_dit.server.edits.router import router as edits_router
from xstage_dit.server.health.router import router as health_router
from xstage_dit.server.http_layer import BodyLimitMiddleware, RequestCountMiddleware, install_error_handlers
from xstage_dit.server.images.router import router as images_router
from xstage_dit.server.jobs.router import router as jobs_router
from xstage_dit.server.loras.router import router as loras_router
from xstage_dit.server.models.router import router as models_router
from xstage_dit.server.page.router import router as page_router
from xstage_dit.server.protocol import error_responses
from xstage_dit.server.videos.router import router as videos_router
from xstage_dit.server.worker import Worker

#: In this order in the OpenAPI schema's paths.
ROUTERS = (page_router, health_router, models_router, images_router, edits_router, videos_router, jobs_router,
           loras_router)


def create_app(worker: Worker, config: ServerConfig | None = None) -> FastAPI:
    """The HTTP app of rank 0. `worker` must be started (`worker.start()`) by the caller."""
    config = config or worker.config
    metrics = worker.metrics
    app = FastAPI(title="xstage_dit server", version=__version__,
                  description="Image and video generation with diffusers DiT pipelines over several GPUs.",
                  responses=error_responses(400, 413, 415, 422),
                  docs_url=None, redoc_url=None)  # served from local assets by install_offline_docs
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes,
                       uploads={path: config.max_upload_bytes for path in UPLOAD_PATHS})
    app.add_middleware(RequestCountMiddleware, metrics=metrics)
    app.state.worker = worker
    app.state.config = config

    install_error_handlers(app, metrics)
    install_offline_docs(app)
    for router in ROUTERS:
        app.include_router(router)
    return app
