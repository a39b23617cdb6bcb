"""`GET /v1/models`, `GET /v1/models/{id}` and `GET /v1/calibration`, the handlers: the served model's card, and
the X-Stage numbers and schedules its ranks chose at start-up."""

from __future__ import annotations

import time

from fastapi.responses import JSONResponse

from xstage_dit.server.config import ServedModel
from xstage_dit.server.deps import served
from xstage_dit.server.models.protocol import InputImagesCard, ModelCard, ModelList
from xstage_dit.server.protocol import RequestError
from xstage_dit.server.worker import Worker

#: the model object's `created`: when this process imported the server (it serves one model from start to end)
STARTED = int(time.time())


def model_card(s: ServedModel) -> ModelCard:
    """What a client needs to know of the served model: kind, defaults, multiples, random weights or not."""
    return ModelCard(id=s.name, created=STARTED, kind=s.kind, default_size=f"{s.default_width}x{s.default_height}",
                     size_multiple=s.size_multiple, default_steps=s.default_steps,
                     default_frames=s.default_frames if s.kind == "video" else None,
                     random_weights=s.weights_notice is not None, weights_notice=s.weights_notice,
                     input_images=_input_images(s))


def _input_images(s: ServedModel) -> InputImagesCard | None:
    facts = s.image_inputs
    if facts is None:
        return None
    return InputImagesCard(min_images=facts.min_images, max_images=facts.max_images,
                           mask=facts.mask_argument is not None,
                           endpoint="/v1/videos (input_reference)" if s.kind == "video" else "/v1/images/edits")


def model_list(worker: Worker) -> ModelList:
    """The one served model, once every rank is ready (503 before)."""
    return ModelList(data=[model_card(served(worker))])


def model_card_of(worker: Worker, model_id: str) -> ModelCard:
    """The card of `model_id` when it is the served model; 404 in the error envelope otherwise."""
    s = served(worker)
    if model_id != s.name:
        raise RequestError("model", f"no model {model_id!r}: this server serves {s.name!r}", 404)
    return model_card(s)


def calibration_report(worker: Worker) -> JSONResponse:
    """The report of the loaded model's calibration and schedules, once every rank is ready (503 before)."""
    served(worker)
    return JSONResponse(worker.model.current_report())
