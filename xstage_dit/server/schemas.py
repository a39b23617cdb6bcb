"""Request and response models of the HTTP API (pydantic), and the checks that depend on the served
model and the server's limits (`image_params`, `video_params`), which turn a request into the
`GenerationRequest` items a job runs (one per image).

Unknown fields are rejected (`extra="forbid"`), so a typo such as `num_inference_step` is a 422 naming
the field rather than a silently ignored option.
"""

from __future__ import annotations

import math
import re
import secrets
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from xstage_dit.runtime.generation import MAX_SEED, GenerationRequest
from xstage_dit.server.config import ServedModel, ServerConfig

_SIZE_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


class RequestError(Exception):
    """A request that is well-formed JSON but not acceptable: answered as `status` with `param` named."""

    def __init__(self, param: str, message: str, status: int = 422, headers: dict[str, str] | None = None):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = f"{param}: {message}"
        self.status = status
        self.headers = headers


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageGenerationRequest(_Strict):
    """`POST /v1/images/generations`: OpenAI's image fields plus diffusion controls."""

    prompt: str = Field(..., description="What to draw (non-empty).", examples=["a red cat on a blue sofa"])
    model: str | None = Field(None, description="Must be the served model's name when given.")
    n: int = Field(1, description="Number of images (seeds seed, seed+1, ...).")
    size: str | None = Field(None, description="'WIDTHxHEIGHT' in pixels, e.g. '64x64'; default: the model's.")
    response_format: Literal["b64_json", "png"] = Field(
        "b64_json", description="'b64_json': JSON with base64 PNGs (OpenAI's form). 'png': the PNG itself as the "
                                "body (image/png; n = 1, no stream), its seed, job id and timings in X- headers: "
                                "no base64 or JSON on a multi-megabyte image.")
    user: str | None = Field(None, description="OpenAI field; accepted and ignored.")
    num_inference_steps: int | None = Field(None, description="Denoising steps; default: the model's.")
    guidance_scale: float | None = Field(None, description="Guidance scale; default: the model's.")
    true_cfg_scale: float | None = Field(
        None, description="True classifier-free guidance (pipelines that have it, e.g. FLUX with a negative prompt).")
    seed: int | None = Field(None, description="Seed of the first image; random when omitted (returned).")
    negative_prompt: str | None = Field(None, description="What to avoid (pipelines that support it).")
    stream: bool = Field(False, description="Answer as server-sent events: per-step progress, then the images.")


class VideoCreateRequest(_Strict):
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


class ImageData(BaseModel):
    b64_json: str = Field(..., description="PNG, base64.")
    seed: int
    revised_prompt: str | None = None


class Timings(BaseModel):
    queued_s: float | None = Field(None, description="Time waiting in the queue.")
    run_s: float | None = Field(None, description="Time in the pipeline (the whole batch).")
    total_s: float | None = Field(None, description="Submission to completion.")
    mean_step_s: float | None = Field(
        None, description="Mean denoising step, from the second step on (for a one-step job: run_s).")
    pipeline_s: float | None = Field(None, description="The batch's pipeline call (prompt encoding to pixels).")
    encode_s: float | None = Field(None, description="PNG/MP4 encoding of the batch's outputs.")
    gc_s: float | None = Field(
        None, description="Python garbage-collection pauses (any thread) during the batch's pipeline call.")


class ImageGenerationResponse(BaseModel):
    created: int
    data: list[ImageData]
    model: str
    job_id: str
    batch_size: int = Field(..., description="Images computed in the same pipeline call.")
    timings: Timings


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


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "xstage_dit"
    kind: Literal["image", "video"]
    default_size: str
    size_multiple: int
    default_steps: int
    default_frames: int | None = None
    random_weights: bool = Field(..., description="True for a built-in model: its outputs are noise, whatever the prompt.")
    weights_notice: str | None = Field(None, description="With random weights: what that means and how to use real ones.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorBody


def error_responses(*codes: int) -> dict[int, dict]:
    """OpenAPI `responses` documenting `codes` as the error envelope (so clients and fuzzers know them)."""
    return {code: {"model": ErrorResponse} for code in codes}


def parse_size(size: str, served: ServedModel, config: ServerConfig) -> tuple[int, int]:
    """'WxH' -> (width, height), checked against the model's multiple (and square rule) and the server's bounds."""
    match = _SIZE_RE.match(size)
    if not match:
        raise RequestError("size", f"expected 'WIDTHxHEIGHT' such as '64x64', got {size!r}")
    # Any digit run is a number (so "100000x100000" is out of range, not malformed); past 18 digits it is
    # out of range without being converted (int() refuses thousands of digits).
    texts = {"width": match.group(1).lstrip("0") or "0", "height": match.group(2).lstrip("0") or "0"}
    for name, text in texts.items():
        if len(text) > 18 or not config.min_size <= int(text) <= config.max_size:
            shown = text if len(text) <= 18 else f"{text[:18]}... ({len(text)} digits)"
            raise RequestError("size", f"expected {name} in [{config.min_size}, {config.max_size}], got {shown}")
    width, height = int(texts["width"]), int(texts["height"])
    for name, value in (("width", width), ("height", height)):
        if value % served.size_multiple:
            raise RequestError("size", f"expected {name} a multiple of {served.size_multiple} for model "
                               f"{served.name}, got {value}")
    if width * height > config.max_pixels:
        raise RequestError("size", f"expected at most {config.max_pixels} pixels, got {width}x{height}")
    if served.square_only and width != height:
        raise RequestError("size", f"expected a square size (width == height) for model {served.name} under sequence "
                           f"parallelism (its transformer splits only square latents), got {width}x{height}")
    return width, height


def _prompt(value: str | None, param: str, config: ServerConfig, required: bool) -> str | None:
    if value is None:
        if required:
            raise RequestError(param, "expected a non-empty string, got null")
        return None
    if required and not value.strip():
        raise RequestError(param, "expected a non-empty string, got an empty one")
    if len(value) > config.max_prompt_chars:
        raise RequestError(param, f"expected at most {config.max_prompt_chars} characters, got {len(value)}")
    return value


def _common(req, served: ServedModel, config: ServerConfig, kind: str) -> dict:
    if req.model is not None and req.model != served.name:
        raise RequestError("model", f"expected {served.name!r} (the served model), got {req.model!r}", 404)
    if served.kind != kind:
        other = "POST /v1/videos" if served.kind == "video" else "POST /v1/images/generations"
        raise RequestError("model", f"expected {'an' if kind == 'image' else 'a'} {kind} model for this endpoint, got {served.name!r} which "
                           f"generates {served.kind}s: use {other}", 400)
    prompt = _prompt(req.prompt, "prompt", config, required=True)
    negative = _prompt(req.negative_prompt, "negative_prompt", config, required=False)
    width, height = (served.default_width, served.default_height) if req.size is None else parse_size(
        req.size, served, config)
    steps = served.default_steps if req.num_inference_steps is None else req.num_inference_steps
    if not 1 <= steps <= config.max_steps:
        raise RequestError("num_inference_steps", f"expected an integer in [1, {config.max_steps}], got {steps}")
    guidance = served.default_guidance if req.guidance_scale is None else req.guidance_scale
    if not (math.isfinite(guidance) and 0 <= guidance <= 100):
        raise RequestError("guidance_scale", f"expected a number in [0, 100], got {guidance}")
    seed = secrets.randbelow(2**31) if req.seed is None else req.seed
    if not 0 <= seed <= MAX_SEED:
        raise RequestError("seed", f"expected an integer in [0, 2**63-1], got {seed}")
    return dict(kind=kind, prompt=prompt, negative_prompt=negative, width=width, height=height, steps=steps,
                guidance=float(guidance), seed=seed)


def image_params(req: ImageGenerationRequest, served: ServedModel, config: ServerConfig) -> list[GenerationRequest]:
    """One one-image `GenerationRequest` per requested image (seeds seed, seed+1, ...)."""
    common = _common(req, served, config, "image")
    if not 1 <= req.n <= config.max_n:
        raise RequestError("n", f"expected an integer in [1, {config.max_n}], got {req.n}")
    if common["seed"] + req.n - 1 > MAX_SEED:
        raise RequestError("seed", f"expected seed + n - 1 <= 2**63-1, got seed {common['seed']} with n {req.n}")
    if req.response_format == "png" and (req.n != 1 or req.stream):
        what = f"n={req.n}" if req.n != 1 else "stream=true"
        raise RequestError("response_format", f"expected n=1 and no stream with response_format 'png' (one image "
                                              f"per body), got {what}")
    true_cfg = req.true_cfg_scale
    if true_cfg is not None and not (math.isfinite(true_cfg) and 0 <= true_cfg <= 100):
        raise RequestError("true_cfg_scale", f"expected a number in [0, 100], got {true_cfg}")
    return GenerationRequest(**common, true_cfg_scale=true_cfg, n=req.n).per_image()


def video_params(req: VideoCreateRequest, served: ServedModel, config: ServerConfig) -> GenerationRequest:
    common = _common(req, served, config, "video")
    frames = served.default_frames if req.num_frames is None else req.num_frames
    if not 1 <= frames <= config.max_frames or (frames - 1) % served.frame_multiple:
        raise RequestError("num_frames",
                           f"expected k*{served.frame_multiple}+1 in [1, {config.max_frames}], got {frames}")
    fps = served.default_fps if req.fps is None else req.fps
    if not 1 <= fps <= 120:
        raise RequestError("fps", f"expected an integer in [1, 120], got {fps}")
    return GenerationRequest(**common, num_frames=frames, fps=fps)
