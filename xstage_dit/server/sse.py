"""Server-sent events of a job: `follow` walks its events (keep-alives; the job cancelled when a client that owns it
leaves), `events` is the jobs and videos endpoints' stream (`progress` after every step, then `completed` or
`error`), `comment` the lines the images endpoint's OpenAI-shaped stream (`images.stream`) carries its progress in."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from xstage_dit.server.job_queue import COMPLETED, TERMINAL, Job
from xstage_dit.server.worker import Worker

SSE_KEEPALIVE_S = 2.0
KEEPALIVE = b": keep-alive\n\n"


def sse(event: str, data: dict) -> bytes:
    """One event: ``event: NAME`` and its JSON on one ``data:`` line."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def comment(kind: str, data: dict) -> bytes:
    """A comment line, ``: KIND {json}``: every SSE client skips it (the standard says so; the OpenAI SDK and
    browsers' EventSource do), a client of ours reads it."""
    return f": {kind} {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def error_event(job: Job) -> bytes:
    """The `error` event of a job that ended without completing (the OpenAI SDK raises it as an APIError)."""
    return sse("error", {"error": {"message": job.error or job.status, "code": job.error_code,
                                   "status": job.status}})


async def follow(worker: Worker, job: Job, cancel_on_disconnect: bool,
                 q: asyncio.Queue | None = None) -> AsyncIterator[dict | None]:
    """`job`'s events (dicts: step snapshots, partial images, the final snapshot last), None when
    `SSE_KEEPALIVE_S` passed without one (send a keep-alive). With `cancel_on_disconnect`, a client that goes away
    before the end cancels the job. `q`: the job's subscription when the caller made it before queueing the job
    (else it subscribes here, starting from the job's current state)."""
    q = job.subscribe() if q is None else q
    try:
        while True:
            try:
                event = await asyncio.wait_for(q.get(), SSE_KEEPALIVE_S)
            except asyncio.TimeoutError:
                yield None
                continue
            yield event
            if event["status"] in TERMINAL and "partial_image" not in event:
                return
    finally:
        job.unsubscribe(q)
        if cancel_on_disconnect and not job.done:
            worker.queue.cancel(job.id)
            worker.metrics.errors.labels("client_disconnected").inc()


async def events(worker: Worker, job: Job, final: Callable[[Job], dict | memoryview] | None,
                 cancel_on_disconnect: bool, q: asyncio.Queue | None = None) -> AsyncIterator[bytes | memoryview]:
    """The event stream of `job` (`follow`'s arguments); `final(job)` is the `completed` payload (the last progress
    event when None): a dict, or JSON already rendered on one line (sent as it is, not copied into the event)."""
    async for event in follow(worker, job, cancel_on_disconnect, q):
        if event is None:
            yield KEEPALIVE
        elif "partial_image" in event:
            continue  # previews belong to the images endpoint's own stream
        elif event["status"] not in TERMINAL:
            yield sse("progress", event)
        elif event["status"] == COMPLETED:
            yield sse("progress", event)
            payload = final(job) if final else event
            if isinstance(payload, dict):
                yield sse("completed", payload)
            else:  # rendered JSON (megabytes of base64): its own chunk of the stream
                yield b"event: completed\ndata: "
                yield payload
                yield b"\n\n"
        else:
            yield error_event(job)


def sse_response(stream: AsyncIterator[bytes], job: Job) -> StreamingResponse:
    return StreamingResponse(stream, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Job-Id": job.id})
