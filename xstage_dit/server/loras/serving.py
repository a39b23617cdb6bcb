"""`GET /v1/loras`, the handler: the served model's adapters from its LoRA manager (rank 0's; every rank holds the
same ones, `features.lora.manager`)."""

from __future__ import annotations

from xstage_dit.server.deps import served
from xstage_dit.server.loras.protocol import LoraCard, LoraList
from xstage_dit.server.protocol import RequestError
from xstage_dit.server.worker import Worker


def lora_list(worker: Worker) -> LoraList:
    """Every adapter under --lora-dir (and preloaded by path), resident or not; 404 when the server serves none."""
    manager = served(worker).lora
    if manager is None:
        raise RequestError("path", "this server serves no LoRA adapters (start it with --lora-dir)", 404)
    config = manager.config
    return LoraList(data=[LoraCard(id=row["name"], resident=row["resident"], active_scale=row["active_scale"],
                                   mode=row["mode"], rank=row["rank"], digest=row["digest"])
                          for row in manager.describe()],
                    max_loras=config.max_loras, max_loras_per_request=config.max_per_request,
                    max_lora_rank=config.max_lora_rank, hotswap=config.hotswap, mode=config.mode,
                    mode_in_use=manager.mode_in_use)
