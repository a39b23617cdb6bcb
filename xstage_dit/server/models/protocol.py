"""`GET /v1/models` and `GET /v1/models/{id}`: the list of served models (one) and its card (OpenAI's model object
plus what a client needs to make a request)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class InputImagesCard(BaseModel):
    """What input images the served pipeline takes (`ImageInputFacts` of its family record)."""

    min_images: int = Field(..., description="Images it needs (0: it also generates from text alone).")
    max_images: int = Field(..., description="Images it takes at most.")
    mask: bool = Field(..., description="It takes a mask (inpainting).")
    endpoint: str = Field(..., description="Where they go: /v1/images/edits, or input_reference of /v1/videos.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(..., description="When this server process started (Unix seconds).")
    owned_by: str = "xstage_dit"
    kind: Literal["image", "video"]
    default_size: str
    size_multiple: int
    default_steps: int
    default_frames: int | None = None
    random_weights: bool = Field(..., description="True for a built-in model: its outputs are noise, whatever the prompt.")
    weights_notice: str | None = Field(None, description="With random weights: what that means and how to use real ones.")
    input_images: InputImagesCard | None = Field(None, description="Image edit / image-to-video models: the input images "
                                                                   "they take; None for text alone.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
