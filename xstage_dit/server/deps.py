"""What every endpoint needs from the app: the worker and config (kept on `app.state` by `create_app`),
the API-key check, the ready model, job submission and lookup. Endpoints never touch the pipeline."""

from __future__ import annotations

import asyncio
import hmac
import time

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse

from xstage_dit.server.config import ServedModel, ServerConfig
from xstage_dit.server.http_layer import error_response
from xstage_dit.server.job_queue import CANCELLED, Job, QueueFull, Unavailable, new_job_id
from xstage_dit.server.protocol import RequestError
from xstage_dit.server.worker import READY, Worker


def worker_of(request: Request) -> Worker:
    return request.app.state.worker


def config_of(request: Request) -> ServerConfig:
    return request.app.state.config


def require_key(request: Request) -> None:
    """Dependency: with an API key configured, expects `Authorization: Bearer <key>` (401 otherwise)."""
    key = config_of(request).api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise RequestError("authorization", "expected 'Bearer <API key>'", 401, headers={"WWW-Authenticate": "Bearer"})


def served(worker: Worker) -> ServedModel:
    """The served model once every rank is ready; 503 with the worker's reason before."""
    if worker.state != READY:
        raise HTTPException(503, f"server {worker.state}: {worker.reason or 'not ready yet'}",
                            headers={"Retry-After": "5"})
    return worker.served


def submit(worker: Worker, config: ServerConfig, items) -> Job:
    """Queues one job of `items` (all image or one video); 429 when the queue is full, 503 when closed."""
    return enqueue(worker, new_job(config, items))


def new_job(config: ServerConfig, items) -> Job:
    """A job of `items` (all image or one video), not queued yet: a streamed request subscribes to it first,
    so that no step's event happens before its client listens."""
    return Job(id=new_job_id("img" if items[0].kind == "image" else "video"), items=items,
               deadline=time.time() + config.request_timeout_s)


def enqueue(worker: Worker, job: Job) -> Job:
    """Queues `job`; 429 when the queue is full, 503 when closed."""
    try:
        return worker.queue.submit(job)
    except QueueFull as exc:
        worker.metrics.errors.labels("queue_full").inc()
        raise HTTPException(429, f"queue: {exc}", headers={"Retry-After": str(exc.retry_after_s)})
    except Unavailable as exc:
        raise HTTPException(503, str(exc), headers={"Retry-After": "5"})


def job_or_404(worker: Worker, job_id: str, kind: str | None = None) -> Job:
    job = worker.queue.get(job_id)
    if job is None or (kind is not None and job.kind != kind):
        raise RequestError("id", f"no {kind or 'job'} {job_id!r}", 404)
    return job


def failure(job: Job) -> JSONResponse:
    """The error answer of a job that ended without completing (its own code, 500 when it has none)."""
    code = job.error_code or 500
    headers = {"Retry-After": "5"} if code == 503 else None
    return error_response(code, job.error or job.status, None, headers)


async def cancel(worker: Worker, job: Job) -> bool:
    """Cancel `job` and wait until it has ended; True when the cancel took effect (the job ended cancelled, now or
    before). A job that had already finished otherwise, or that ran its last step (or its decode) when the cancel
    came, ends completed: False, and the caller answers 409 with its state. The wait is at most one step: a running
    job stops at the next step's check (`JobQueue.step`)."""
    if not job.done:
        q = job.subscribe(progress=False)
        try:
            worker.queue.cancel(job.id)
            while not job.done:
                try:
                    await asyncio.wait_for(q.get(), 1.0)
                except asyncio.TimeoutError:
                    pass
        finally:
            job.unsubscribe(q)
    return job.status == CANCELLED


def too_late(job: Job, state: dict, key: str) -> JSONResponse:
    """409: the cancel of `job` came too late (it is `job.status`), with its state under `key`."""
    return error_response(409, f"id: cannot cancel {job.id!r}: it is {job.status} (the cancel came after its last "
                               f"step)" if job.status == "completed" else f"id: cannot cancel {job.id!r}: it is "
                               f"{job.status}", "id", extra={key: state})
