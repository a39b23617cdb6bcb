"""`GET /v1/loras`: the LoRA adapters a request may name, and which are resident."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class LoraCard(BaseModel):
    id: str = Field(..., description="The name a request's `lora` entry gives.")
    object: Literal["lora"] = "lora"
    resident: bool = Field(..., description="Loaded on every rank now (a request for it loads nothing).")
    active_scale: float | None = Field(None, description="Its scale in the adapter set of the last call.")
    mode: Literal["fused", "unfused"] | None = Field(None, description="How it ran in the last call (None: not in "
                                                                       "it): merged into the weights, or its layers.")
    rank: int | None = Field(None, description="Its LoRA rank (known once resident).")
    digest: str | None = Field(None, description="sha256 prefix of its file (known once resident).")


class LoraList(BaseModel):
    object: Literal["list"] = "list"
    data: list[LoraCard]
    max_loras: int = Field(..., description="Adapters resident at once (least recently used evicted past it).")
    max_loras_per_request: int
    max_lora_rank: int
    hotswap: bool = Field(..., description="Compiled: adapters are copied into slots compiled in (no recompile).")
    mode: Literal["auto", "fused", "unfused"] = Field(..., description="The server's --lora-mode.")
    mode_in_use: Literal["fused", "unfused"] | None = Field(
        None, description="How the last call's adapters ran (auto decides per adapter set); None: it had none.")
