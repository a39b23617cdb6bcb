"""`/v1/videos`: the request model, the video object (OpenAI's ``Video``, what the SDK parses, plus our fields),
the list and delete answers, and `video_params`, which checks a request against the served model and the server's
limits and turns it into the job's one item.

``seconds`` (OpenAI's duration, a string such as "4") becomes frames through the frame rate and the model's frame
rule (``k * frame_multiple + 1`` frames): ``frames = frame_multiple * floor(seconds * fps / frame_multiple + 1/2)
+ 1``, the nearest valid count to ``seconds * fps`` (halves up), so Wan (16 fps, multiple 4) makes 65 frames of
"4" (4.0625 s) and 81 of "5". The video object's ``seconds`` is the clip's real length, ``num_frames / fps``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, Field

from xstage_dit.runtime.conditioning import made_size
from xstage_dit.runtime.generation import GenerationRequest
from xstage_dit.server.config import ServedModel, ServerConfig
from xstage_dit.server.image_input import reference_inputs
from xstage_dit.server.protocol import (CACHE_THRESHOLD_FIELD, LORA_FIELD, LoraList, RequestError, StrictModel,
                                        Timings, common_params)


class VideoCreateRequest(StrictModel):
    """`POST /v1/videos` (JSON or multipart/form-data, as OpenAI's SDK sends it): an asynchronous video job."""

    prompt: str = Field(..., description="What to film (non-empty).", examples=["a cat walking on grass"])
    model: str | None = Field(None, description="Must be the served model's name when given.")
    seconds: str | float | None = Field(
        None, description="Clip length in seconds (OpenAI's field, e.g. '4'): frames = the nearest k*frame_multiple+1 "
                          "to seconds*fps. Give it or num_frames.")
    size: str | None = Field(None, description="'WIDTHxHEIGHT' in pixels; default: the model's.")
    input_reference: str | dict[str, Any] | list[str | dict[str, Any]] | None = Field(
        None, description="Image-to-video models: the first frame, a file in multipart, or in JSON base64, a data: URL "
                          "or {\"image_url\": a data: URL}; first-last-frame models (Wan FLF2V): the first and the "
                          "last frame, two files in multipart or a JSON list of two; a text-to-video model refuses it.")
    num_frames: int | None = Field(None, description="Frames (k * frame_multiple + 1); default: the model's.")
    fps: int | None = Field(None, description="Frames per second of the MP4; default: the model's.")
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    negative_prompt: str | None = None
    lora: LoraList = LORA_FIELD
    cache_threshold: float | None = CACHE_THRESHOLD_FIELD


class VideoError(BaseModel):
    code: str = Field(..., description="cancelled, timeout, server_unavailable or generation_failed.")
    message: str


class VideoJob(BaseModel):
    """OpenAI's video object (status, integer progress, created_at / completed_at / expires_at, error {code,
    message}, seconds, size, model, prompt) and ours (steps, frames, fps, seed, timings). A cancelled or timed-out
    job is ``failed`` with its error's code saying which."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: Literal["queued", "in_progress", "completed", "failed"]
    progress: int = Field(..., description="Percent of the denoising steps done (0..100; 100 once completed).")
    created_at: int
    completed_at: int | None = Field(None, description="When the job finished (completed or failed).")
    expires_at: int | None = Field(None, description="When the server forgets the finished job and its MP4.")
    error: VideoError | None = None
    prompt: str
    seconds: str = Field(..., description="The clip's length: num_frames / fps.")
    size: str
    steps_done: int
    steps_total: int
    num_frames: int
    fps: int
    seed: int
    timings: Timings


class VideoList(BaseModel):
    """`GET /v1/videos`: OpenAI's cursor page (pass ``last_id`` as ``after`` for the next one)."""

    object: Literal["list"] = "list"
    data: list[VideoJob]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool


def frames_for_seconds(seconds: float, fps: int, frame_multiple: int) -> int:
    """The nearest frame count of the form k * frame_multiple + 1 to seconds * fps (halves up)."""
    return frame_multiple * math.floor(seconds * fps / frame_multiple + 0.5) + 1


def _seconds(value: str | float) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise RequestError("seconds", f"expected a number of seconds such as '4', got {value!r}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise RequestError("seconds", f"expected a positive number of seconds, got {value!r}")
    return seconds


def video_params(req: VideoCreateRequest, served: ServedModel, config: ServerConfig,
                 reference_files: list[bytes] | None = None) -> GenerationRequest:
    """The one `GenerationRequest` of a video job: `num_frames` of the form k * frame_multiple + 1 (or from
    `seconds`), fps in [1, 120], defaults from the served model, the first frame of an image-to-video model from
    ``input_reference``. reference_files: the bytes of the multipart ``input_reference`` files, in order (else the
    JSON field)."""
    common = common_params(req, served, config, "video")
    fps = served.default_fps if req.fps is None else req.fps
    if not 1 <= fps <= 120:
        raise RequestError("fps", f"expected an integer in [1, 120], got {fps}")
    if req.seconds is not None and req.num_frames is not None:
        raise RequestError("seconds", f"expected seconds or num_frames, got both ({req.seconds!r} and "
                                      f"{req.num_frames})")
    if req.seconds is not None:
        seconds = _seconds(req.seconds)
        frames = frames_for_seconds(seconds, fps, served.frame_multiple)
        if frames > config.max_frames:
            raise RequestError("seconds", f"expected at most {(config.max_frames - 1) / fps:g} s at {fps} fps "
                                          f"({config.max_frames} frames), got {req.seconds!r} ({frames} frames)")
    else:
        frames = served.default_frames if req.num_frames is None else req.num_frames
        if not 1 <= frames <= config.max_frames or (frames - 1) % served.frame_multiple:
            raise RequestError("num_frames",
                               f"expected k*{served.frame_multiple}+1 in [1, {config.max_frames}], got {frames}")
    reference = reference_files if reference_files else req.input_reference
    inputs = reference_inputs(reference, served, config)  # 4xx where the model takes no image, or needs one
    made = made_size(served.image_inputs, inputs)
    if made is not None:  # the pipeline sizes the video from the image (HunyuanVideo 1.5 I2V)
        asked = (common["width"], common["height"])
        if req.size is not None and req.size.strip().lower() != "auto" and asked != made:
            raise RequestError("size", f"expected no size or '{made[0]}x{made[1]}' for {served.name} (its pipeline "
                                       f"sizes the video from the input image), got {req.size!r}")
        common.update(width=made[0], height=made[1])
    return GenerationRequest(**common, num_frames=frames, fps=fps, inputs=inputs)
