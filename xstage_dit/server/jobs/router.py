"""`/v1/jobs/{id}`: the state, events and cancellation of any job (image or video); the handlers are in
`xstage_dit.server.jobs.serving`."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from xstage_dit.server.deps import require_key, worker_of
from xstage_dit.server.jobs import serving
from xstage_dit.server.protocol import error_responses
from xstage_dit.server.worker import Worker

router = APIRouter(dependencies=[Depends(require_key)], responses=error_responses(401, 404))


@router.get("/v1/jobs/{job_id}")
async def get_job(job_id: str, worker: Worker = Depends(worker_of)):
    return serving.state(worker, job_id)


@router.get("/v1/jobs/{job_id}/events", responses={200: {"content": {"text/event-stream": {}}}})
async def job_events(job_id: str, worker: Worker = Depends(worker_of)):
    """Per-step progress of any job (image or video) as server-sent events."""
    return serving.event_stream(worker, job_id)


@router.delete("/v1/jobs/{job_id}", responses=error_responses(409))
async def cancel_job(job_id: str, worker: Worker = Depends(worker_of)):
    """Cancel a job: 200 with its state once it stopped; 409 with its state when the cancel came too late."""
    return await serving.cancel(worker, job_id)
