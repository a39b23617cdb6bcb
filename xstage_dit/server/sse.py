"""Server-sent events of one job: `progress` after every step, then `completed` (or `error`); the images, videos
and jobs endpoints stream them."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from xstage_dit.server.job_queue import COMPLETED, TERMINAL, Job
from xstage_dit.server.worker import Worker

SSE_KEEPALIVE_S = 2.0


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def events(worker: Worker, job: Job, final: Callable[[Job], dict | memoryview] | None,
                 cancel_on_disconnect: bool, q: asyncio.Queue | None = None) -> AsyncIterator[bytes | memoryview]:
    """The event stream of `job`; `final(job)` is the `completed` payload (the last progress event when
    None): a dict, or JSON already rendered on one line (sent as it is, not copied into the event). With
    `cancel_on_disconnect`, a client that goes away before the end cancels the job. `q`: the job's
    subscription when the caller made it before queueing the job (else it subscribes here, starting from the
    job's current state)."""
    q = job.subscribe() if q is None else q
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
                payload = final(job) if final else event
                if isinstance(payload, dict):
                    yield _sse("completed", payload)
                else:  # rendered JSON (megabytes of base64): its own chunk of the stream
                    yield b"event: completed\ndata: "
                    yield payload
                    yield b"\n\n"
            else:
                yield _sse("error", {"error": {"message": job.error or job.status, "code": job.error_code,
                                               "status": job.status}})
            return
    finally:
        job.unsubscribe(q)
        if cancel_on_disconnect and not job.done:
            worker.queue.cancel(job.id)
            worker.metrics.errors.labels("client_disconnected").inc()


def sse_response(stream: AsyncIterator[bytes], job: Job) -> StreamingResponse:
    return StreamingResponse(stream, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Job-Id": job.id})
