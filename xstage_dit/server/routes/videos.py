"""`/v1/videos`: asynchronous video jobs (create, poll, content as MP4, cancel, events)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from xstage_dit.server.config import ServerConfig
from xstage_dit.server.jobs import COMPLETED, Job
from xstage_dit.server.routes.deps import config_of, job_or_404, require_key, served, submit, worker_of
from xstage_dit.server.routes.events import events, sse_response
from xstage_dit.server.schemas import (Progress, RequestError, Timings, VideoCreateRequest, VideoJob, error_responses,
                                       video_params)
from xstage_dit.server.worker import Worker

router = APIRouter(dependencies=[Depends(require_key)], responses=error_responses(401, 404, 503))


def video_payload(worker: Worker, job: Job) -> VideoJob:
    """The state of a video job: status, step progress, its parameters and timings."""
    item = job.items[0]
    total = max(job.steps_total, 1)
    return VideoJob(id=job.id, model=worker.served.name, status=job.status,
                    progress=Progress(steps_done=job.steps_done, steps_total=job.steps_total,
                                      fraction=round(job.steps_done / total, 4)),
                    created_at=int(job.created), size=f"{item.width}x{item.height}",
                    num_frames=item.num_frames, fps=item.fps, seed=item.seed, error=job.error,
                    timings=Timings(**job.timings()))


@router.post("/v1/videos", response_model=VideoJob, status_code=202, responses=error_responses(429))
async def create_video(req: VideoCreateRequest, worker: Worker = Depends(worker_of),
                       config: ServerConfig = Depends(config_of)):
    """Queue a video job; poll `GET /v1/videos/{id}` or stream `GET /v1/videos/{id}/events`."""
    job = submit(worker, config, [video_params(req, served(worker), config)])
    return JSONResponse(video_payload(worker, job).model_dump(), status_code=202)


@router.get("/v1/videos/{video_id}", response_model=VideoJob)
async def get_video(video_id: str, worker: Worker = Depends(worker_of)):
    return video_payload(worker, job_or_404(worker, video_id, "video"))


@router.get("/v1/videos/{video_id}/content",
            responses={200: {"content": {"video/mp4": {}}}, **error_responses(409)})
async def video_content(video_id: str, worker: Worker = Depends(worker_of)):
    job = job_or_404(worker, video_id, "video")
    if job.status != COMPLETED:
        raise RequestError("id", f"video {video_id!r} is {job.status}, not completed", 409)
    return Response(job.results[0], media_type="video/mp4",
                    headers={"Content-Disposition": f'inline; filename="{job.id}.mp4"'})


@router.delete("/v1/videos/{video_id}", response_model=VideoJob)
async def cancel_video(video_id: str, worker: Worker = Depends(worker_of)):
    """Cancel: a queued job at once, a running one at its next denoising step."""
    job_or_404(worker, video_id, "video")
    return video_payload(worker, worker.queue.cancel(video_id))


@router.get("/v1/videos/{video_id}/events", responses={200: {"content": {"text/event-stream": {}}}})
async def video_events(video_id: str, worker: Worker = Depends(worker_of)):
    job = job_or_404(worker, video_id, "video")
    return sse_response(events(worker, job, lambda j: video_payload(worker, j).model_dump(), False), job)
