"""`GET /v1/models` (the one served model), `GET /v1/models/{id}` (its card; 404 for another id) and
`GET /v1/calibration` (X-Stage numbers and the schedules chosen at start-up); the handlers are in
`xstage_dit.server.models.serving`."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from xstage_dit.server.deps import require_key, worker_of
from xstage_dit.server.models import serving
from xstage_dit.server.models.protocol import ModelCard, ModelList
from xstage_dit.server.protocol import error_responses
from xstage_dit.server.worker import Worker

router = APIRouter(dependencies=[Depends(require_key)], responses=error_responses(401, 503))


@router.get("/v1/models", response_model=ModelList)
async def models(worker: Worker = Depends(worker_of)):
    return serving.model_list(worker)


@router.get("/v1/models/{model_id}", response_model=ModelCard, responses=error_responses(404))
async def model(model_id: str, worker: Worker = Depends(worker_of)):
    """The served model's card (OpenAI's model object); 404 for any other id."""
    return serving.model_card_of(worker, model_id)


@router.get("/v1/calibration", summary="X-Stage numbers and the schedules chosen at start-up")
async def calibration(worker: Worker = Depends(worker_of)):
    return serving.calibration_report(worker)
