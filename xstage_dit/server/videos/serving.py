"""`/v1/videos`, the handlers: queue a video job (JSON or multipart, `request_body`), answer its state
(`video_payload`, OpenAI's video object), list the jobs (OpenAI's cursor page), its assets once completed
(`content`), delete it (cancelling a job still running) and its event stream."""

from __future__ import annotations

import asyncio
import math

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from xstage_dit.server import deps
from xstage_dit.server.config import ServerConfig
from xstage_dit.server.deps import job_or_404, served, submit
from xstage_dit.server.job_queue import CANCELLED, COMPLETED, FAILED, Job
from xstage_dit.server.protocol import RequestError, Timings
from xstage_dit.server.request_body import parse_as, read_body
from xstage_dit.server.sse import events, sse_response
from xstage_dit.server.videos import content as assets
from xstage_dit.server.videos.protocol import (VideoCreateRequest, VideoDeleted, VideoError, VideoJob, VideoList,
                                               video_params)
from xstage_dit.server.worker import Worker

FILE_FIELDS = ("input_reference",)
#: job error code (HTTP-like) -> the video object's error code
ERROR_CODES = {499: "cancelled", 504: "timeout", 503: "server_unavailable"}


def _progress(job: Job) -> int:
    """Percent of the steps done: 100 only once completed (decoding and encoding follow the last step)."""
    if job.status == COMPLETED:
        return 100
    return min(99, math.floor(100 * job.steps_done / max(job.steps_total, 1)))


def video_payload(worker: Worker, job: Job) -> VideoJob:
    """The video object of a job: OpenAI's fields (a cancelled or timed-out job is failed, its error's code says
    which) and ours (steps, frames, fps, seed, timings)."""
    item = job.items[0]
    failed = job.status in (FAILED, CANCELLED)
    error = VideoError(code=ERROR_CODES.get(job.error_code, "generation_failed"), message=job.error or job.status) \
        if failed else None
    finished = int(job.finished) if job.finished is not None else None
    return VideoJob(id=job.id, model=worker.served.name, status=FAILED if failed else job.status,
                    progress=_progress(job), created_at=int(job.created), completed_at=finished,
                    expires_at=None if finished is None else finished + int(worker.config.job_ttl_s), error=error,
                    prompt=item.prompt, seconds=f"{item.num_frames / item.fps:g}", size=f"{item.width}x{item.height}",
                    steps_done=job.steps_done, steps_total=job.steps_total, num_frames=item.num_frames, fps=item.fps,
                    seed=item.seed, timings=Timings(**job.timings()))


async def create(request: Request, worker: Worker, config: ServerConfig) -> JSONResponse:
    """Queue the video of the request (JSON or multipart/form-data) as one job; 202 with its state. Everything is
    checked before anything is queued."""
    body = await read_body(request, file_fields=FILE_FIELDS)
    req = parse_as(VideoCreateRequest, body.fields)
    files = body.files.get("input_reference") or []  # several: the first and last frame (counted against the model)
    item = video_params(req, served(worker), config, reference_files=[f.data for f in files])
    job = submit(worker, config, [item])
    return JSONResponse(video_payload(worker, job).model_dump(), status_code=202)


def state(worker: Worker, video_id: str) -> VideoJob:
    return video_payload(worker, job_or_404(worker, video_id, "video"))


def listing(worker: Worker, after: str | None, limit: int, order: str) -> VideoList:
    """The video jobs the server holds, by creation time (`order` asc or desc), `limit` of them after the one
    named `after` (404 when the server does not hold it)."""
    jobs = sorted((j for j in worker.queue.jobs() if j.kind == "video"), key=lambda j: (j.created, j.id),
                  reverse=order == "desc")
    start = 0
    if after is not None:
        ids = [j.id for j in jobs]
        if after not in ids:
            raise RequestError("after", f"no video {after!r} (it never existed, was deleted or expired)", 404)
        start = ids.index(after) + 1
    page = jobs[start:start + limit]
    return VideoList(data=[video_payload(worker, j) for j in page], first_id=page[0].id if page else None,
                     last_id=page[-1].id if page else None, has_more=start + limit < len(jobs))


async def content(worker: Worker, video_id: str, variant: str) -> Response:
    """An asset of a completed video job (`videos.content`: the MP4, its first frame, a spritesheet); 409 naming
    its status before."""
    job = job_or_404(worker, video_id, "video")
    if job.status != COMPLETED:
        raise RequestError("id", f"video {video_id!r} is {job.status}, not completed", 409)
    data = await asyncio.to_thread(assets.asset, job.results[0], variant)
    return Response(data, media_type=assets.MEDIA_TYPES[variant],
                    headers={"Content-Disposition": f'inline; filename="{job.id}.{assets.SUFFIXES[variant]}"'})


async def delete(worker: Worker, video_id: str) -> Response:
    """Delete a video: a job still queued or running is cancelled first (the answer waits for it to stop, at most a
    step); when the cancel comes too late (its last step ran, it completes) the answer is 409 with its state and
    nothing is deleted. The job and its MP4 are then forgotten (GET answers 404)."""
    job = job_or_404(worker, video_id, "video")
    if not job.done and not await deps.cancel(worker, job):
        return deps.too_late(job, video_payload(worker, job).model_dump(), "video")
    worker.queue.delete(job.id)
    return JSONResponse(VideoDeleted(id=job.id, deleted=True).model_dump())


def event_stream(worker: Worker, video_id: str) -> StreamingResponse:
    """Progress events of a video job, then `completed` with its state (a client that leaves cancels nothing)."""
    job = job_or_404(worker, video_id, "video")
    return sse_response(events(worker, job, lambda j: video_payload(worker, j).model_dump(), False), job)
