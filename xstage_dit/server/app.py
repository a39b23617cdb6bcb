"""FastAPI routes: images (sync or streamed), video jobs, per-job server-sent events, health, metrics,
models, calibration, and the web page at `/`.

The app only talks to a `Worker` (rank 0's side of the multi-rank worker) and its `JobQueue`; it never
touches the pipeline. Errors always have the shape `{"error": {"message", "type", "param", "code"}}`,
and the message names the offending field.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import time
from importlib import resources
from typing import AsyncIterator, Callable

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from xstage_dit.server.config import ServerConfig
from xstage_dit.server.http_layer import BodyLimitMiddleware, RequestCountMiddleware, error_response, first_validation_error
from xstage_dit.server.jobs import COMPLETED, TERMINAL, Job, QueueFull, Unavailable, new_job_id
from xstage_dit.server.metrics import CONTENT_TYPE_LATEST
from xstage_dit.server.schemas import (ErrorResponse, ImageData, ImageGenerationRequest, ImageGenerationResponse, ModelCard,
                            ModelList, Progress, RequestError, Timings, VideoCreateRequest, VideoJob, image_params,
                            video_params)
from xstage_dit.server.worker import READY, Worker

SSE_KEEPALIVE_S = 2.0
DISCONNECT_POLL_S = 0.25


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def create_app(worker: Worker, config: ServerConfig | None = None) -> FastAPI:
    """The HTTP app of rank 0. `worker` must be started (`worker.start()`) by the caller."""
    config = config or worker.config
    queue, metrics = worker.queue, worker.metrics
    app = FastAPI(title="xstage_dit server", version="0.1.0",
                  description="Image and video generation with diffusers DiT pipelines over several GPUs.",
                  responses={400: {"model": ErrorResponse}, 422: {"model": ErrorResponse}})
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    app.state.worker = worker

    app.add_middleware(RequestCountMiddleware, metrics=metrics)

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

    def require_key(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise HTTPException(401, "authorization: expected 'Bearer <API key>'",
                                headers={"WWW-Authenticate": "Bearer"})

    def served():
        if worker.state != READY:
            raise HTTPException(503, f"server {worker.state}: {worker.reason or 'not ready yet'}",
                                headers={"Retry-After": "5"})
        return worker.served

    def submit(items) -> Job:
        job = Job(id=new_job_id("img" if items[0].kind == "image" else "video"), items=items,
                  deadline=time.time() + config.request_timeout_s)
        try:
            return queue.submit(job)
        except QueueFull as exc:
            metrics.errors.labels("queue_full").inc()
            raise HTTPException(429, f"queue: {exc}", headers={"Retry-After": str(exc.retry_after_s)})
        except Unavailable as exc:
            raise HTTPException(503, str(exc), headers={"Retry-After": "5"})

    def job_or_404(job_id: str, kind: str | None = None) -> Job:
        job = queue.get(job_id)
        if job is None or (kind is not None and job.kind != kind):
            raise HTTPException(404, f"id: no {kind or 'job'} {job_id!r}")
        return job

    def image_payload(job: Job) -> dict:
        timings = job.timings()
        return ImageGenerationResponse(
            created=int(job.created), model=worker.served.name, job_id=job.id, batch_size=job.batch_size,
            data=[ImageData(b64_json=base64.b64encode(png).decode(), seed=item.seed)
                  for png, item in zip(job.results, job.items)],
            timings=Timings(**timings)).model_dump()

    def video_payload(job: Job) -> VideoJob:
        item = job.items[0]
        total = max(job.steps_total, 1)
        return VideoJob(id=job.id, model=worker.served.name, status=job.status,
                        progress=Progress(steps_done=job.steps_done, steps_total=job.steps_total,
                                          fraction=round(job.steps_done / total, 4)),
                        created_at=int(job.created), size=f"{item.width}x{item.height}",
                        num_frames=item.num_frames, fps=item.fps, seed=item.seed, error=job.error,
                        timings=Timings(**job.timings()))

    def failure(job: Job) -> JSONResponse:
        code = job.error_code or 500
        headers = {"Retry-After": "5"} if code == 503 else None
        return error_response(code, job.error or job.status, None, headers)

    async def events(job: Job, request: Request | None, final: Callable[[Job], dict] | None,
                     cancel_on_disconnect: bool) -> AsyncIterator[bytes]:
        q = job.subscribe()
        try:
            while True:
                try:
                    event = await asyncio.wait_for(q.get(), SSE_KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                if event["status"] not in TERMINAL:
                    yield _sse("progress", event)
                    continue
                if event["status"] == COMPLETED:
                    yield _sse("progress", event)
                    yield _sse("completed", final(job) if final else event)
                else:
                    yield _sse("error", {"error": {"message": job.error or job.status, "code": job.error_code,
                                                   "status": job.status}})
                return
        finally:
            job.unsubscribe(q)
            if cancel_on_disconnect and not job.done:
                queue.cancel(job.id)
                metrics.errors.labels("client_disconnected").inc()

    def sse_response(generator: AsyncIterator[bytes], job: Job) -> StreamingResponse:
        return StreamingResponse(generator, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Job-Id": job.id})

    # ------------------------------------------------------------------ routes
    @app.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(resources.files("xstage_dit.server").joinpath("static/index.html").read_text(encoding="utf-8"))

    @app.get("/health", summary="Ready only when every rank is")
    async def health():
        body = {"status": worker.state, "world_size": worker.ctx.world_size if worker.ctx else None,
                "model": worker.served.name if worker.served else None, "reason": worker.reason,
                "queue_depth": queue.depth, "running": queue.running,
                "ranks": [worker.ranks[r] for r in sorted(worker.ranks)]}
        return JSONResponse(body, status_code=200 if worker.state == READY else 503)

    @app.get("/metrics", summary="Prometheus metrics")
    async def prometheus():
        metrics.queue_depth.set(queue.depth)
        metrics.running_jobs.set(queue.running)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, dependencies=[Depends(require_key)])
    async def models():
        s = served()
        return ModelList(data=[ModelCard(id=s.name, kind=s.kind, default_size=f"{s.default_width}x{s.default_height}",
                                         size_multiple=s.size_multiple, default_steps=s.default_steps,
                                         default_frames=s.default_frames if s.kind == "video" else None)])

    @app.get("/v1/calibration", summary="X-Stage numbers and the schedules chosen at start-up",
             dependencies=[Depends(require_key)])
    async def calibration():
        served()
        return JSONResponse(worker.model.current_report())

    @app.post("/v1/images/generations", response_model=ImageGenerationResponse,
              responses={429: {"model": ErrorResponse}, 503: {"model": ErrorResponse}},
              dependencies=[Depends(require_key)])
    async def generate_images(req: ImageGenerationRequest, request: Request):
        """Generate `n` PNG images. With `"stream": true` the answer is server-sent events: `progress`
        after every step, then `completed` with this endpoint's usual JSON (or `error`)."""
        job = submit(image_params(req, served(), config))
        if req.stream:
            return sse_response(events(job, request, image_payload, cancel_on_disconnect=True), job)
        q = job.subscribe()
        try:
            next_check = time.monotonic() + DISCONNECT_POLL_S
            while not job.done:
                try:
                    await asyncio.wait_for(q.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    pass
                if time.monotonic() >= next_check:  # on a clock: progress events may come faster
                    next_check = time.monotonic() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        queue.cancel(job.id)  # the client went away: free its place
                        metrics.errors.labels("client_disconnected").inc()
                        return error_response(499, "client disconnected")
        finally:
            job.unsubscribe(q)
        if job.status != COMPLETED:
            return failure(job)
        return JSONResponse(image_payload(job), headers={"X-Job-Id": job.id})

    @app.post("/v1/videos", response_model=VideoJob, status_code=202,
              responses={429: {"model": ErrorResponse}, 503: {"model": ErrorResponse}},
              dependencies=[Depends(require_key)])
    async def create_video(req: VideoCreateRequest):
        """Queue a video job; poll `GET /v1/videos/{id}` or stream `GET /v1/videos/{id}/events`."""
        job = submit([video_params(req, served(), config)])
        return JSONResponse(video_payload(job).model_dump(), status_code=202)

    @app.get("/v1/videos/{video_id}", response_model=VideoJob, dependencies=[Depends(require_key)])
    async def get_video(video_id: str):
        return video_payload(job_or_404(video_id, "video"))

    @app.get("/v1/videos/{video_id}/content", dependencies=[Depends(require_key)],
             responses={200: {"content": {"video/mp4": {}}}, 409: {"model": ErrorResponse}})
    async def video_content(video_id: str):
        job = job_or_404(video_id, "video")
        if job.status != COMPLETED:
            raise HTTPException(409, f"id: video {video_id!r} is {job.status}, not completed")
        return Response(job.results[0], media_type="video/mp4",
                        headers={"Content-Disposition": f'inline; filename="{job.id}.mp4"'})

    @app.delete("/v1/videos/{video_id}", response_model=VideoJob, dependencies=[Depends(require_key)])
    async def cancel_video(video_id: str):
        """Cancel: a queued job at once, a running one at its next denoising step."""
        job_or_404(video_id, "video")
        return video_payload(queue.cancel(video_id))

    @app.get("/v1/videos/{video_id}/events", dependencies=[Depends(require_key)],
             responses={200: {"content": {"text/event-stream": {}}}})
    async def video_events(video_id: str, request: Request):
        job = job_or_404(video_id, "video")
        return sse_response(events(job, request, lambda j: video_payload(j).model_dump(), False), job)

    @app.get("/v1/jobs/{job_id}", dependencies=[Depends(require_key)])
    async def get_job(job_id: str):
        job = job_or_404(job_id)
        return {**job.snapshot(), "kind": job.kind, "timings": job.timings(), "batch_size": job.batch_size}

    @app.get("/v1/jobs/{job_id}/events", dependencies=[Depends(require_key)],
             responses={200: {"content": {"text/event-stream": {}}}})
    async def job_events(job_id: str, request: Request):
        """Per-step progress of any job (image or video) as server-sent events."""
        job = job_or_404(job_id)
        return sse_response(events(job, request, None, False), job)

    @app.delete("/v1/jobs/{job_id}", dependencies=[Depends(require_key)])
    async def cancel_job(job_id: str):
        job = queue.cancel(job_or_404(job_id).id)
        return job.snapshot()

    return app
