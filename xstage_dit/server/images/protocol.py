"""`POST /v1/images/generations`: the request and response models, and `image_params`, which checks a request
against the served model and the server's limits and turns it into the job's items (one per image)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, Field

from xstage_dit.runtime.generation import MAX_SEED, GenerationRequest
from xstage_dit.server.config import ServedModel, ServerConfig
from xstage_dit.server.protocol import LORA_FIELD, LoraList, RequestError, StrictModel, Timings, common_params


class ImageGenerationRequest(StrictModel):
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
    lora: LoraList = LORA_FIELD


class ImageData(BaseModel):
    b64_json: str = Field(..., description="PNG, base64.")
    seed: int
    revised_prompt: str | None = None


class ImageGenerationResponse(BaseModel):
    created: int
    data: list[ImageData]
    model: str
    job_id: str
    batch_size: int = Field(..., description="Images computed in the same pipeline call.")
    timings: Timings


def image_params(req: ImageGenerationRequest, served: ServedModel, config: ServerConfig) -> list[GenerationRequest]:
    """One one-image `GenerationRequest` per requested image (seeds seed, seed+1, ...)."""
    common = common_params(req, served, config, "image")
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
