"""`GET /v1/models` (the one served model) and `GET /v1/calibration` (X-Stage numbers and the schedules
chosen at start-up); the handlers are in `xstage_dit.server.models.serving`."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from xstage_dit.server.deps import require_key, worker_of
from xstage_dit.server.models import serving
from xstage_dit.server.models.protocol import ModelList
from xstage_dit.server.protocol import error_responses
from xstage_dit.server.worker import Worker

router = APIRouter(dependencies=[Depends(require_key)], responses=error_responses(401, 503))


@router.get("/v1/models", response_model=ModelList)
async def models(worker: Worker = Depends(worker_of)):
    return serving.model_list(worker)


@router.get("/v1/calibration", summary="X-Stage numbers and the schedules chosen at start-up")
async def calibration(worker: Worker = Depends(worker_of)):
    return serving.calibration_report(worker)
