"""`GET /v1/loras` (the adapters a request may name, which are resident); the handler is in
`xstage_dit.server.loras.serving`."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from xstage_dit.server.deps import require_key, worker_of
from xstage_dit.server.loras import serving
from xstage_dit.server.loras.protocol import LoraList
from xstage_dit.server.protocol import error_responses
from xstage_dit.server.worker import Worker

router = APIRouter(dependencies=[Depends(require_key)], responses=error_responses(401, 404, 503))


@router.get("/v1/loras", response_model=LoraList)
async def loras(worker: Worker = Depends(worker_of)):
    """The LoRA adapters requests may name (`lora` field of the generation endpoints), and which are resident."""
    return serving.lora_list(worker)
