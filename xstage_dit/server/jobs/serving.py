"""`/v1/jobs/{id}`, the handlers: the state of any job (image or video) as a plain dict, its events, its
cancellation."""

from __future__ import annotations

from fastapi.responses import StreamingResponse

from xstage_dit.server.deps import job_or_404
from xstage_dit.server.sse import events, sse_response
from xstage_dit.server.worker import Worker


def state(worker: Worker, job_id: str) -> dict:
    """The job's snapshot (id, status, steps) with its kind, timings and batch size."""
    job = job_or_404(worker, job_id)
    return {**job.snapshot(), "kind": job.kind, "timings": job.timings(), "batch_size": job.batch_size}


def event_stream(worker: Worker, job_id: str) -> StreamingResponse:
    """Per-step progress, then the last progress event as `completed` (a client that leaves cancels nothing)."""
    job = job_or_404(worker, job_id)
    return sse_response(events(worker, job, None, False), job)


def cancel(worker: Worker, job_id: str) -> dict:
    """Cancel: a queued job at once, a running one at its next denoising step; its snapshot after."""
    return worker.queue.cancel(job_or_404(worker, job_id).id).snapshot()
