"""`GET /v1/models` and `GET /v1/calibration`, the handlers: the served model's card, and the X-Stage numbers
and schedules its ranks chose at start-up."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from xstage_dit.server.config import ServedModel
from xstage_dit.server.deps import served
from xstage_dit.server.models.protocol import InputImagesCard, ModelCard, ModelList
from xstage_dit.server.worker import Worker


def model_card(s: ServedModel) -> ModelCard:
    """What a client needs to know of the served model: kind, defaults, multiples, random weights or not."""
    return ModelCard(id=s.name, kind=s.kind, default_size=f"{s.default_width}x{s.default_height}",
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


def calibration_report(worker: Worker) -> JSONResponse:
    """The report of the loaded model's calibration and schedules, once every rank is ready (503 before)."""
    served(worker)
    return JSONResponse(worker.model.current_report())
