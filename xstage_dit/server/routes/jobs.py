"""`/v1/jobs/{id}`: the state, events and cancellation of any job (image or video)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from xstage_dit.server.routes.deps import job_or_404, require_key, worker_of
from xstage_dit.server.routes.events import events, sse_response
from xstage_dit.server.schemas import error_responses
from xstage_dit.server.worker import Worker

router = APIRouter(dependencies=[Depends(require_key)], responses=error_responses(401, 404))


@router.get("/v1/jobs/{job_id}")
async def get_job(job_id: str, worker: Worker = Depends(worker_of)):
    job = job_or_404(worker, job_id)
    return {**job.snapshot(), "kind": job.kind, "timings": job.timings(), "batch_size": job.batch_size}


@router.get("/v1/jobs/{job_id}/events", responses={200: {"content": {"text/event-stream": {}}}})
async def job_events(job_id: str, worker: Worker = Depends(worker_of)):
    """Per-step progress of any job (image or video) as server-sent events."""
    job = job_or_404(worker, job_id)
    return sse_response(events(worker, job, None, False), job)


@router.delete("/v1/jobs/{job_id}")
async def cancel_job(job_id: str, worker: Worker = Depends(worker_of)):
    job = worker.queue.cancel(job_or_404(worker, job_id).id)
    return job.snapshot()
