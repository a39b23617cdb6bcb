"""`POST /v1/images/edits`: synchronous (the client waits; leaving cancels the job) or streamed; the handler is
`xstage_dit.server.edits.serving.edit`."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from xstage_dit.server.config import ServerConfig
from xstage_dit.server.deps import config_of, require_key, worker_of
from xstage_dit.server.edits import serving
from xstage_dit.server.images.protocol import ImageGenerationResponse
from xstage_dit.server.protocol import error_responses
from xstage_dit.server.worker import Worker

router = APIRouter(dependencies=[Depends(require_key)],
                   responses=error_responses(400, 401, 404, 413, 415, 422, 429, 499, 503, 504))


@router.post("/v1/images/edits", response_model=ImageGenerationResponse, openapi_extra=serving.OPENAPI_BODY,
             responses={200: {"content": {"text/event-stream": {}, "image/png": {}}}})
async def edit_images(request: Request, worker: Worker = Depends(worker_of),
                      config: ServerConfig = Depends(config_of)):
    """Edit input images (FLUX.1 Kontext, Qwen-Image-Edit, FLUX.2 references, FLUX.1 img2img / Fill with a mask):
    OpenAI's multipart form (``image`` / ``image[]`` files, ``mask``) or JSON with base64 images. The answer is
    ``/v1/images/generations``'s: JSON with base64 PNGs, the PNG itself (``response_format: png``) or server-sent
    events (``stream: true``)."""
    return await serving.edit(request, worker, config)
