"""`POST /v1/images/generations`: synchronous (the client waits; leaving cancels the job) or streamed; the
handler is `xstage_dit.server.images.serving.generate`."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from xstage_dit.server.config import ServerConfig
from xstage_dit.server.deps import config_of, require_key, worker_of
from xstage_dit.server.images import serving
from xstage_dit.server.images.protocol import ImageGenerationRequest, ImageGenerationResponse
from xstage_dit.server.protocol import error_responses
from xstage_dit.server.worker import Worker

router = APIRouter(dependencies=[Depends(require_key)], responses=error_responses(400, 401, 404, 429, 499, 503, 504, 507))


@router.post("/v1/images/generations", response_model=ImageGenerationResponse,
             responses={200: {"content": {"text/event-stream": {}, "image/png": {}}}})
async def generate_images(req: ImageGenerationRequest, request: Request, worker: Worker = Depends(worker_of),
                          config: ServerConfig = Depends(config_of)):
    """Generate `n` images (PNG, JPEG or WebP: `output_format`). With `"stream": true` the answer is OpenAI's
    server-sent events: `image_generation.partial_image` (the `partial_images` previews), then one
    `image_generation.completed` per image (or `error`), per-step progress in `: xstage.progress` comment lines.
    With `"response_format": "png"` the body is the one image's PNG (`image/png`)."""
    return await serving.generate(req, request, worker, config)
