"""`GET /v1/models` (the one served model) and `GET /v1/calibration` (X-Stage numbers and the schedules
chosen at start-up)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from xstage_dit.server.routes.deps import require_key, served, worker_of
from xstage_dit.server.schemas import ModelCard, ModelList, error_responses
from xstage_dit.server.worker import Worker

router = APIRouter(dependencies=[Depends(require_key)], responses=error_responses(401, 503))


@router.get("/v1/models", response_model=ModelList)
async def models(worker: Worker = Depends(worker_of)):
    s = served(worker)
    return ModelList(data=[ModelCard(id=s.name, kind=s.kind, default_size=f"{s.default_width}x{s.default_height}",
                                     size_multiple=s.size_multiple, default_steps=s.default_steps,
                                     default_frames=s.default_frames if s.kind == "video" else None,
                                     random_weights=s.weights_notice is not None, weights_notice=s.weights_notice)])


@router.get("/v1/calibration", summary="X-Stage numbers and the schedules chosen at start-up")
async def calibration(worker: Worker = Depends(worker_of)):
    served(worker)
    return JSONResponse(worker.model.current_report())
