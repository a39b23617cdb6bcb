"""`/v1/videos`: asynchronous video jobs in OpenAI's shape (create from JSON or multipart, retrieve, list, content
as MP4 / thumbnail / spritesheet, delete) plus their event stream; the handlers are in
`xstage_dit.server.videos.serving`."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Query, Request

from xstage_dit.server.config import ServerConfig
from xstage_dit.server.deps import config_of, require_key, worker_of
from xstage_dit.server.protocol import error_responses
from xstage_dit.server.request_body import openapi_body
from xstage_dit.server.videos import serving
from xstage_dit.server.videos.content import MEDIA_TYPES
from xstage_dit.server.videos.protocol import VideoCreateRequest, VideoDeleted, VideoJob, VideoList
from xstage_dit.server.worker import Worker

router = APIRouter(dependencies=[Depends(require_key)], responses=error_responses(401, 404, 503))


@router.post("/v1/videos", response_model=VideoJob, status_code=202, responses=error_responses(400, 429),
             openapi_extra=openapi_body(VideoCreateRequest, serving.FILE_FIELDS))
async def create_video(request: Request, worker: Worker = Depends(worker_of),
                       config: ServerConfig = Depends(config_of)):
    """Queue a video job (JSON, or multipart/form-data as OpenAI's SDK sends it); poll `GET /v1/videos/{id}` or
    stream `GET /v1/videos/{id}/events`."""
    return await serving.create(request, worker, config)


@router.get("/v1/videos", response_model=VideoList)
async def list_videos(after: str | None = Query(None, description="The last id of the previous page."),
                      limit: int = Query(20, ge=1, le=100), order: Literal["asc", "desc"] = "desc",
                      worker: Worker = Depends(worker_of)):
    """The video jobs this server holds, newest first by default (OpenAI's cursor page)."""
    return serving.listing(worker, after, limit, order)


@router.get("/v1/videos/{video_id}", response_model=VideoJob)
async def get_video(video_id: str, worker: Worker = Depends(worker_of)):
    return serving.state(worker, video_id)


@router.get("/v1/videos/{video_id}/content",
            responses={200: {"content": {media: {} for media in MEDIA_TYPES.values()}}, **error_responses(409)})
async def video_content(video_id: str, variant: Literal["video", "thumbnail", "spritesheet"] = "video",
                        worker: Worker = Depends(worker_of)):
    """The completed video's MP4 (`variant=video`), its first frame as a PNG (`thumbnail`) or up to 16 frames
    tiled into a JPEG (`spritesheet`)."""
    return await serving.content(worker, video_id, variant)


@router.delete("/v1/videos/{video_id}", response_model=VideoDeleted, responses=error_responses(409))
async def delete_video(video_id: str, worker: Worker = Depends(worker_of)):
    """Delete a video; a queued or running one is cancelled first. 409 with its state when the cancel comes too
    late (the job ran its last step and completes)."""
    return await serving.delete(worker, video_id)


@router.get("/v1/videos/{video_id}/events", responses={200: {"content": {"text/event-stream": {}}}})
async def video_events(video_id: str, worker: Worker = Depends(worker_of)):
    return serving.event_stream(worker, video_id)
