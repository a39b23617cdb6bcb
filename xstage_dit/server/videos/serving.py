"""`/v1/videos`, the handlers: queue a video job, answer its state (`video_payload`), its MP4 once completed,
its cancellation and its event stream."""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response, StreamingResponse

from xstage_dit.server.config import ServerConfig
from xstage_dit.server.deps import job_or_404, served, submit
from xstage_dit.server.job_queue import COMPLETED, Job
from xstage_dit.server.protocol import RequestError, Timings
from xstage_dit.server.sse import events, sse_response
from xstage_dit.server.videos.protocol import Progress, VideoCreateRequest, VideoJob, video_params
from xstage_dit.server.worker import Worker


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


def create(req: VideoCreateRequest, worker: Worker, config: ServerConfig) -> JSONResponse:
    """Queue the video of `req` as one job; 202 with its state."""
    job = submit(worker, config, [video_params(req, served(worker), config)])
    return JSONResponse(video_payload(worker, job).model_dump(), status_code=202)


def state(worker: Worker, video_id: str) -> VideoJob:
    return video_payload(worker, job_or_404(worker, video_id, "video"))


def content(worker: Worker, video_id: str) -> Response:
    """The MP4 of a completed video job; 409 naming its status before."""
    job = job_or_404(worker, video_id, "video")
    if job.status != COMPLETED:
        raise RequestError("id", f"video {video_id!r} is {job.status}, not completed", 409)
    return Response(job.results[0], media_type="video/mp4",
                    headers={"Content-Disposition": f'inline; filename="{job.id}.mp4"'})


def cancel(worker: Worker, video_id: str) -> VideoJob:
    job_or_404(worker, video_id, "video")
    return video_payload(worker, worker.queue.cancel(video_id))


def event_stream(worker: Worker, video_id: str) -> StreamingResponse:
    """Progress events of a video job, then `completed` with its state (a client that leaves cancels nothing)."""
    job = job_or_404(worker, video_id, "video")
    return sse_response(events(worker, job, lambda j: video_payload(worker, j).model_dump(), False), job)
