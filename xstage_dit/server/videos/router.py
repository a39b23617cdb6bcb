"""`/v1/videos`: asynchronous video jobs (create, poll, content as MP4, cancel, events); the handlers are in
`xstage_dit.server.videos.serving`."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from xstage_dit.server.config import ServerConfig
from xstage_dit.server.deps import config_of, require_key, worker_of
from xstage_dit.server.protocol import error_responses
from xstage_dit.server.videos import serving
from xstage_dit.server.videos.protocol import VideoCreateRequest, VideoJob
from xstage_dit.server.worker import Worker

router = APIRouter(dependencies=[Depends(require_key)], responses=error_responses(401, 404, 503))


@router.post("/v1/videos", response_model=VideoJob, status_code=202, responses=error_responses(400, 429))
async def create_video(req: VideoCreateRequest, worker: Worker = Depends(worker_of),
                       config: ServerConfig = Depends(config_of)):
    """Queue a video job; poll `GET /v1/videos/{id}` or stream `GET /v1/videos/{id}/events`."""
    return serving.create(req, worker, config)


@router.get("/v1/videos/{video_id}", response_model=VideoJob)
async def get_video(video_id: str, worker: Worker = Depends(worker_of)):
    return serving.state(worker, video_id)


@router.get("/v1/videos/{video_id}/content",
            responses={200: {"content": {"video/mp4": {}}}, **error_responses(409)})
async def video_content(video_id: str, worker: Worker = Depends(worker_of)):
    return serving.content(worker, video_id)


@router.delete("/v1/videos/{video_id}", response_model=VideoJob)
async def cancel_video(video_id: str, worker: Worker = Depends(worker_of)):
    """Cancel: a queued job at once, a running one at its next denoising step."""
    return serving.cancel(worker, video_id)


@router.get("/v1/videos/{video_id}/events", responses={200: {"content": {"text/event-stream": {}}}})
async def video_events(video_id: str, worker: Worker = Depends(worker_of)):
    return serving.event_stream(worker, video_id)
