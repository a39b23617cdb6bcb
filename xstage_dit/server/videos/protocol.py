"""`/v1/videos`: the request model, the video job's state as answered, and `video_params`, which checks a
request against the served model and the server's limits and turns it into the job's one item."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from xstage_dit.runtime.generation import GenerationRequest
from xstage_dit.server.config import ServedModel, ServerConfig
from xstage_dit.server.protocol import LORA_FIELD, LoraList, RequestError, StrictModel, Timings, common_params


class VideoCreateRequest(StrictModel):
    """`POST /v1/videos`: an asynchronous video job."""

    prompt: str = Field(..., description="What to film (non-empty).", examples=["a cat walking on grass"])
    model: str | None = Field(None, description="Must be the served model's name when given.")
    size: str | None = Field(None, description="'WIDTHxHEIGHT' in pixels; default: the model's.")
    num_frames: int | None = Field(None, description="Frames (k * frame_multiple + 1); default: the model's.")
    fps: int | None = Field(None, description="Frames per second of the MP4; default: the model's.")
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    negative_prompt: str | None = None
    lora: LoraList = LORA_FIELD


class Progress(BaseModel):
    steps_done: int
    steps_total: int
    fraction: float


class VideoJob(BaseModel):
    id: str
    object: Literal["video"] = "video"
    model: str
    status: Literal["queued", "in_progress", "completed", "failed", "cancelled"]
    progress: Progress
    created_at: int
    size: str
    num_frames: int
    fps: int
    seed: int
    error: str | None = None
    timings: Timings


def video_params(req: VideoCreateRequest, served: ServedModel, config: ServerConfig) -> GenerationRequest:
    """The one `GenerationRequest` of a video job: `num_frames` of the form k * frame_multiple + 1, fps in
    [1, 120], defaults from the served model."""
    common = common_params(req, served, config, "video")
    frames = served.default_frames if req.num_frames is None else req.num_frames
    if not 1 <= frames <= config.max_frames or (frames - 1) % served.frame_multiple:
        raise RequestError("num_frames",
                           f"expected k*{served.frame_multiple}+1 in [1, {config.max_frames}], got {frames}")
    fps = served.default_fps if req.fps is None else req.fps
    if not 1 <= fps <= 120:
        raise RequestError("fps", f"expected an integer in [1, 120], got {fps}")
    return GenerationRequest(**common, num_frames=frames, fps=fps)
