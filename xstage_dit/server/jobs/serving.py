"""`/v1/jobs/{id}`, the handlers: the state of any job (image or video) as a plain dict, its events, its
cancellation (409 when it comes too late)."""

from __future__ import annotations

from fastapi.responses import JSONResponse, StreamingResponse

from xstage_dit.server import deps
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


async def cancel(worker: Worker, job_id: str) -> dict | JSONResponse:
    """Cancel: a queued job at once, a running one at its next denoising step (the answer waits for it); its
    snapshot after. 409 with the snapshot under "job" when the job completed (or failed) instead: the cancel came
    after its last step, or after its end."""
    job = job_or_404(worker, job_id)
    if not await deps.cancel(worker, job):
        return deps.too_late(job, job.snapshot(), "job")
    return job.snapshot()
