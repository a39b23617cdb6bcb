"""What every endpoint's protocol shares: the error envelope and `RequestError`, the strict base of request
models, `Timings`, and the checks that depend on the served model and the server's limits (size, prompt,
steps, guidance, seed) that `images.protocol.image_params` and `videos.protocol.video_params` start from.

Unknown fields are rejected (`extra="forbid"` on `StrictModel`), so a typo such as `num_inference_step` is a
422 naming the field rather than a silently ignored option. Each endpoint's own request and response models
live in its package (`xstage_dit.server.images.protocol`, `.videos.protocol`, `.models.protocol`).
"""

from __future__ import annotations

import math
import re
import secrets

from pydantic import BaseModel, ConfigDict, Field

from xstage_dit.features.lora.config import MAX_SCALE, MIN_SCALE, AdapterError, adapter_list
from xstage_dit.runtime.generation import MAX_SEED
from xstage_dit.server.config import ServedModel, ServerConfig

_SIZE_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


class RequestError(Exception):
    """A request that is well-formed JSON but not acceptable: answered as `status` with `param` named."""

    def __init__(self, param: str, message: str, status: int = 422, headers: dict[str, str] | None = None,
                 named: bool = False):
        """named: `message` already starts with the field's name (a pydantic error said the project's way)."""
        full = message if named else f"{param}: {message}"
        super().__init__(full)
        self.param = param
        self.message = full
        self.status = status
        self.headers = headers


class StrictModel(BaseModel):
    """The base of every request model: an unknown field is a 422 naming it."""

    model_config = ConfigDict(extra="forbid")


class LoraEntry(StrictModel):
    """One LoRA adapter of a request: its name (a file or folder under the server's --lora-dir) and scale."""

    name: str = Field(..., description="Adapter name (see GET /v1/loras); never a path.", examples=["style"])
    scale: float = Field(1.0, description=f"How much of it is added, in [{MIN_SCALE:g}, {MAX_SCALE:g}] (0: none).")


CACHE_THRESHOLD_FIELD = Field(
    None, description="This request's step-cache threshold (servers started with --cache fbcache or magcache; 0 never "
                      "skips with fbcache); default: the server's.")
LORA_FIELD = Field(None, description="LoRA adapters for this request, combined in the order given: objects "
                                     "{name, scale} or bare names (scale 1.0). Requests run in one batch only with "
                                     "requests of the same adapters and scales.",
                   examples=[[{"name": "style", "scale": 0.8}]])
LoraList = list[LoraEntry | str] | None


class StepCacheCounts(BaseModel):
    method: str = Field(..., description="The server's step cache (--cache): fbcache, taylorseer, magcache, ...")
    unit: str = Field(..., description="What was counted: 'steps' (denoising steps computed fully or with the "
                                       "cached blocks) or 'attention calls' (pab, fastercache).")
    computed: int
    skipped: int


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
    step_cache: StepCacheCounts | None = Field(
        None, description="The request's step cache: what it computed and skipped (null: no step cache runs).")


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


def check_prompt(value: str | None, param: str, config: ServerConfig, required: bool) -> str | None:
    """`value` within the server's prompt length; with `required`, not null and not blank."""
    if value is None:
        if required:
            raise RequestError(param, "expected a non-empty string, got null")
        return None
    if required and not value.strip():
        raise RequestError(param, "expected a non-empty string, got an empty one")
    if len(value) > config.max_prompt_chars:
        raise RequestError(param, f"expected at most {config.max_prompt_chars} characters, got {len(value)}")
    return value


def common_params(req, served: ServedModel, config: ServerConfig, kind: str) -> dict:
    """The `GenerationRequest` fields every kind shares, checked: `req` is an image or video request model
    (its `model`, `prompt`, `negative_prompt`, `size`, `num_inference_steps`, `guidance_scale`, `seed`)."""
    if req.model is not None and req.model != served.name:
        raise RequestError("model", f"expected {served.name!r} (the served model), got {req.model!r}", 404)
    if served.kind != kind:
        other = "POST /v1/videos" if served.kind == "video" else "POST /v1/images/generations"
        raise RequestError("model", f"expected {'an' if kind == 'image' else 'a'} {kind} model for this endpoint, got {served.name!r} which "
                           f"generates {served.kind}s: use {other}", 400)
    prompt = check_prompt(req.prompt, "prompt", config, required=True)
    negative = check_prompt(req.negative_prompt, "negative_prompt", config, required=False)
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
                guidance=float(guidance), seed=seed, lora=lora_params(getattr(req, "lora", None), served),
                cache_threshold=cache_threshold(req, served))


def lora_params(entries, served: ServedModel) -> tuple[tuple[str, float], ...]:
    """A request's ``lora`` field checked against what the server serves (`ServedModel.lora`, the LoRA manager):
    ((name, scale), ...). 400 when the server has no LoRA or for too many adapters or a scale out of range, 404
    naming an adapter it does not have."""
    if not entries:
        return ()
    manager = served.lora
    if manager is None:
        raise RequestError("lora", f"expected no adapters: this server serves none (start it with --lora-dir), got "
                                   f"{len(entries)}", 400)
    try:
        wanted = adapter_list(entries, manager.config.max_per_request)
    except AdapterError as exc:
        raise RequestError("lora", str(exc).removeprefix("lora: "), exc.status) from None
    available = manager.available()
    for name, _ in wanted:
        if name not in available:
            raise RequestError("lora", f"no adapter {name!r} (available: {', '.join(sorted(available)) or 'none'})",
                               404)
    return wanted


def cache_threshold(req, served: ServedModel) -> float | None:
    """The request's ``cache_threshold`` checked against the served step cache (None where not given)."""
    value = getattr(req, "cache_threshold", None)
    if value is None:
        return None
    if served.step_cache is None:
        raise RequestError("cache_threshold", f"this server runs no step cache (start it with --cache fbcache or "
                                              f"magcache), got {value}", 400)
    if not served.cache_threshold:
        raise RequestError("cache_threshold", f"the server's step cache {served.step_cache['method']} decides "
                                              f"without a threshold (a step counter or a fixed schedule), got {value}",
                           400)
    if not (math.isfinite(value) and 0 <= value <= 100):
        raise RequestError("cache_threshold", f"expected a number in [0, 100], got {value}")
    return float(value)
