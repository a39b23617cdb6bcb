"""`POST /v1/images/generations`: the request and response models, and `image_params`, which checks a request
against the served model and the server's limits and turns it into the job's items (one per image), the encoding of
its images and what the answer reports.

Every parameter of the OpenAI SDK's ``images.generate`` (openai 3.63) is a field here, and each is either honoured
or refused with a 4xx naming it and saying why (docs/serving.md has the table):

- honoured: ``prompt``, ``model``, ``n``, ``size`` (``"auto"`` = the model's default), ``quality`` (a fraction of
  the model's default steps, `QUALITY_STEPS`, unless ``num_inference_steps`` is given), ``output_format``
  png / jpeg / webp with ``output_compression`` (jpeg / webp quality), ``background`` opaque / auto, ``stream``
  with ``partial_images`` 0..3, ``response_format`` b64_json;
- accepted, not applied: ``moderation`` (no moderation model runs here), ``user`` and ``safety_identifier``
  (echoed as the answer's ``safety_identifier``, never logged);
- refused: ``background: transparent`` (no model here makes a chosen transparency), ``response_format: url`` (no
  image store to link to), ``style`` (a DALL-E 3 preset, no such control in a diffusion pipeline: say it in the
  prompt), ``complexity`` (no planning stage), ``output_format`` gif / svg with ``frame_count``,
  ``frame_duration_ms`` and ``svg``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from xstage_dit.runtime.generation import MAX_SEED, GenerationRequest
from xstage_dit.server.config import ServedModel, ServerConfig
from xstage_dit.server.media import ImageEncoding
from xstage_dit.server.protocol import (CACHE_THRESHOLD_FIELD, LORA_FIELD, LoraList, RequestError, StrictModel,
                                        Timings, common_params)

#: quality -> fraction of the model's default steps (rounded half up, at least 1, at most --max-steps).
#: "standard" / "hd" are DALL-E 3's names for medium / high; "auto" is the model's default.
QUALITY_STEPS = {"low": 0.25, "medium": 0.5, "high": 1.0, "auto": 1.0, "standard": 0.5, "hd": 1.0,
                 "xhigh": 1.5, "max": 2.0}
#: the quality an answer reports (OpenAI's answer has no "standard", "hd" or "auto").
QUALITY_REPORTED = {"standard": "medium", "hd": "high", "auto": "high"}
MAX_PARTIAL_IMAGES = 3


class ImageGenerationRequest(StrictModel):
    """`POST /v1/images/generations`: every field of OpenAI's ``images.generate`` plus diffusion controls."""

    prompt: str = Field(..., description="What to draw (non-empty).", examples=["a red cat on a blue sofa"])
    model: str | None = Field(None, description="Must be the served model's name when given.")
    n: int | None = Field(1, description="Number of images (seeds seed, seed+1, ...).")
    size: str | None = Field(None, description="'WIDTHxHEIGHT' in pixels, e.g. '64x64'; 'auto' or omitted: the "
                                               "model's default.")
    quality: Literal["low", "medium", "high", "xhigh", "max", "auto", "standard", "hd"] | None = Field(
        None, description="Steps as a fraction of the model's default: low 1/4, medium (standard) 1/2, high (hd, "
                          "auto) 1, xhigh 1.5, max 2; num_inference_steps wins when given.")
    output_format: Literal["png", "jpeg", "webp", "gif", "svg"] | None = Field(
        None, description="png (default, lossless), jpeg or webp; gif and svg are refused.")
    output_compression: int | None = Field(
        None, description="jpeg / webp quality 0..100 (default 100: the least loss); not for png.")
    background: Literal["transparent", "opaque", "auto"] | None = Field(
        None, description="opaque: no alpha channel; auto (default): what the model makes; transparent is refused.")
    moderation: Literal["low", "auto"] | None = Field(None, description="Accepted; no moderation is applied.")
    response_format: Literal["b64_json", "png", "url"] | None = Field(
        "b64_json", description="'b64_json': JSON with base64 images (OpenAI's form). 'png': the PNG itself as the "
                                "body (image/png; n = 1, no stream), its seed, job id and timings in X- headers. "
                                "'url' is refused (no image store).")
    stream: bool | None = Field(False, description="Answer as server-sent events: OpenAI's image_generation.* "
                                                   "events, per-step progress in comment lines.")
    partial_images: int | None = Field(None, description="Streams only: 0..3 previews decoded from the latents "
                                                         "during the run.")
    user: str | None = Field(None, description="Accepted; echoed as safety_identifier when that is not given.")
    safety_identifier: str | None = Field(None, description="Accepted; echoed in the answer, never logged.")
    style: Literal["vivid", "natural"] | None = Field(None, description="Refused: no style presets (use the prompt).")
    complexity: Literal["low", "medium", "high"] | None = Field(None, description="Refused: no planning stage.")
    frame_count: int | None = Field(None, description="Refused: no GIF output.")
    frame_duration_ms: int | None = Field(None, description="Refused: no GIF output.")
    svg: dict[str, Any] | None = Field(None, description="Refused: no SVG output.")
    num_inference_steps: int | None = Field(None, description="Denoising steps; default: the model's (or quality's).")
    guidance_scale: float | None = Field(None, description="Guidance scale; default: the model's.")
    true_cfg_scale: float | None = Field(
        None, description="True classifier-free guidance (pipelines that have it, e.g. FLUX with a negative prompt).")
    seed: int | None = Field(None, description="Seed of the first image; random when omitted (returned).")
    negative_prompt: str | None = Field(None, description="What to avoid (pipelines that support it).")
    lora: LoraList = LORA_FIELD
    cache_threshold: float | None = CACHE_THRESHOLD_FIELD


class ImageData(BaseModel):
    b64_json: str = Field(..., description="The image (output_format), base64.")
    seed: int
    revised_prompt: str | None = None


class UsageDetails(BaseModel):
    image_tokens: int
    text_tokens: int


class Usage(BaseModel):
    """OpenAI's usage shape: output_tokens counts the transformer's image tokens of the outputs ((width /
    size_multiple) x (height / size_multiple) per image); prompt tokens are not counted (0)."""

    input_tokens: int
    input_tokens_details: UsageDetails
    output_tokens: int
    total_tokens: int


class ImageGenerationResponse(BaseModel):
    created: int
    data: list[ImageData]
    model: str
    job_id: str
    batch_size: int = Field(..., description="Images computed in the same pipeline call.")
    timings: Timings
    background: Literal["transparent", "opaque"] | None = None
    output_format: Literal["png", "jpeg", "webp"] = "png"
    quality: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    size: str | None = None
    usage: Usage | None = None
    safety_identifier: str | None = None


@dataclass(frozen=True)
class ImageJobSpec:
    """A checked image request: its items (one per image), how its images are encoded, the previews its stream
    wants, and what its answer reports (quality None: steps were given; safety_identifier as echoed)."""

    items: list[GenerationRequest]
    encoding: ImageEncoding
    partial_images: int
    quality: str | None
    safety_identifier: str | None

    @property
    def size(self) -> str:
        return f"{self.items[0].width}x{self.items[0].height}"

    def usage(self, size_multiple: int) -> Usage:
        tokens = len(self.items) * (self.items[0].width // size_multiple) * (self.items[0].height // size_multiple)
        return Usage(input_tokens=0, input_tokens_details=UsageDetails(image_tokens=0, text_tokens=0),
                     output_tokens=tokens, total_tokens=tokens)


def _refuse_unsupported(req: ImageGenerationRequest) -> None:
    """400 naming each OpenAI field this server does not do, and why."""
    refusals = (
        ("background", req.background == "transparent", "'transparent' is not supported: the served models make no "
         "chosen transparency; use 'opaque' or 'auto'"),
        ("response_format", req.response_format == "url", "'url' is not supported: this server keeps no image store "
         "to link to; use 'b64_json' (or 'png' for the image itself)"),
        ("style", req.style is not None, f"{req.style!r} is not supported: style presets are a DALL-E 3 control a "
         "diffusion pipeline does not have; describe the style in the prompt"),
        ("complexity", req.complexity is not None, "not supported: a diffusion pipeline has no separate planning "
         "stage; use quality or num_inference_steps for more or less computation"),
        ("output_format", req.output_format in ("gif", "svg"), f"{req.output_format!r} is not supported: expected "
         "'png', 'jpeg' or 'webp'"),
        ("frame_count", req.frame_count is not None, "not supported: GIF output is not supported (output_format "
         "png, jpeg or webp)"),
        ("frame_duration_ms", req.frame_duration_ms is not None, "not supported: GIF output is not supported "
         "(output_format png, jpeg or webp)"),
        ("svg", req.svg is not None, "not supported: SVG output is not supported (output_format png, jpeg or webp)"),
    )
    for param, refused, why in refusals:
        if refused:
            raise RequestError(param, why, 400)


def _encoding(req: ImageGenerationRequest) -> ImageEncoding:
    fmt = req.output_format or "png"
    compression = req.output_compression
    if compression is not None and fmt == "png":
        raise RequestError("output_compression", f"applies to output_format 'jpeg' and 'webp' only (png is lossless), "
                                                 f"got {compression} with 'png'", 400)
    if compression is not None and not 0 <= compression <= 100:
        raise RequestError("output_compression", f"expected an integer in [0, 100], got {compression}")
    if req.response_format == "png" and fmt != "png":
        raise RequestError("response_format", f"'png' answers with the PNG itself; with output_format {fmt!r} ask "
                                              f"for 'b64_json'", 400)
    quality = None if fmt == "png" else (100 if compression is None else compression)
    return ImageEncoding(fmt, quality, opaque=req.background == "opaque")


def _steps(req: ImageGenerationRequest, served: ServedModel, config: ServerConfig) -> tuple[int | None, str | None]:
    """(steps to use, or None for common_params' default; the quality the answer reports)."""
    if req.num_inference_steps is not None:
        return req.num_inference_steps, None
    quality = req.quality or "auto"
    steps = math.floor(served.default_steps * QUALITY_STEPS[quality] + 0.5)
    return max(1, min(config.max_steps, steps)), QUALITY_REPORTED.get(quality, quality)


def image_params(req: ImageGenerationRequest, served: ServedModel, config: ServerConfig) -> ImageJobSpec:
    """The checked job of `req`: one one-image `GenerationRequest` per requested image (seeds seed, seed+1, ...),
    its encoding and previews; `RequestError` naming the first bad or refused field."""
    _refuse_unsupported(req)
    steps, quality = _steps(req, served, config)
    size = None if req.size is None or req.size.strip().lower() == "auto" else req.size
    common = common_params(req.model_copy(update={"size": size, "num_inference_steps": steps}), served, config,
                           "image")
    n = 1 if req.n is None else req.n
    if not 1 <= n <= config.max_n:
        raise RequestError("n", f"expected an integer in [1, {config.max_n}], got {n}")
    if common["seed"] + n - 1 > MAX_SEED:
        raise RequestError("seed", f"expected seed + n - 1 <= 2**63-1, got seed {common['seed']} with n {n}")
    if req.response_format == "png" and (n != 1 or req.stream):
        what = f"n={n}" if n != 1 else "stream=true"
        raise RequestError("response_format", f"expected n=1 and no stream with response_format 'png' (one image "
                                              f"per body), got {what}")
    encoding = _encoding(req)
    partial = req.partial_images or 0
    if not 0 <= partial <= MAX_PARTIAL_IMAGES:
        raise RequestError("partial_images", f"expected an integer in [0, {MAX_PARTIAL_IMAGES}], got {partial}")
    if partial and not req.stream:
        raise RequestError("partial_images", f"previews are sent in a stream only: expected stream=true with "
                                             f"partial_images {partial}, got no stream", 400)
    if partial and not served.previews:
        raise RequestError("partial_images", f"model {served.name} has no decode of step latents (its family record "
                                             f"names no latent_decode): expected 0, got {partial}", 400)
    true_cfg = req.true_cfg_scale
    if true_cfg is not None and not (math.isfinite(true_cfg) and 0 <= true_cfg <= 100):
        raise RequestError("true_cfg_scale", f"expected a number in [0, 100], got {true_cfg}")
    items = GenerationRequest(**common, true_cfg_scale=true_cfg, n=n).per_image()
    return ImageJobSpec(items, encoding, partial, quality, req.safety_identifier or req.user or None)
