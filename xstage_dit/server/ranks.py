"""Who the serving ranks are and how rank 0 talks to them: `RankContext` (this process's place, joined from
torchrun's environment), `ControlChannel` (tagged rank-0 broadcasts over the gloo control group), the
TCPStore the heartbeats and batch statuses go through, and `LoadedModel` (what every rank's loader returns).
The protocol itself is described in `xstage_dit.server.worker`.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from xstage_dit.server.config import ServedModel


@dataclass
class LoadedModel:
    """What a rank's factory returns: the pipeline (parallelized when world > 1), what it serves, and
    the start-up report (calibration numbers and schedule choices) shown at `/v1/calibration`."""

    pipe: Any
    served: ServedModel
    report: dict = field(default_factory=dict)
    describe: Callable[[], dict] | None = None  # the report as of now (schedules are chosen per shape, lazily)
    # The `xstage_dit.engine.Engine` whose stack the loader applied (batch invariance included); None for a
    # pipeline handed in as it is, to which the worker applies batch invariance itself.
    engine: Any = None
    adapters: Any = None  # the engine's LoRA manager (`features.lora.LoraManager`), None without LoRA
    recovery: Any = None  # rebuilds the engine's groups after a forward failed on one rank (`server.recovery`)

    def current_report(self) -> dict:
        return self.describe() if self.describe is not None else self.report


@dataclass
class RankContext:
    """This process's place among the serving ranks. world_size 1: no groups, no store."""

    rank: int = 0
    world_size: int = 1
    control_group: Any = None
    store_host: str = "127.0.0.1"
    collective_timeout_s: float = 600.0
    device: Any = "cpu"

    @classmethod
    def join(cls, collective_timeout_s: float = 600.0) -> "RankContext":
        """Join the ranks started by torchrun or `xstage-dit serve` (env RANK, WORLD_SIZE, MASTER_ADDR...)."""
        from xstage_dit.comm.distributed import init_distributed

        info = init_distributed(timeout_s=collective_timeout_s)
        if info.world_size == 1:
            return cls(device=info.device)
        import torch.distributed as dist

        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=collective_timeout_s))
        return cls(info.rank, info.world_size, group, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   collective_timeout_s, info.device)


class ControlChannel:
    """Tagged rank-0 broadcasts over the gloo control group (no-ops at world size 1)."""

    def __init__(self, ctx: RankContext):
        self.ctx = ctx

    def send(self, message: tuple) -> None:
        if self.ctx.world_size > 1:
            import torch.distributed as dist

            dist.broadcast_object_list([message], src=0, group=self.ctx.control_group)

    def recv(self) -> tuple:
        import torch.distributed as dist

        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.ctx.control_group)
        return box[0]


class RankDesync(RuntimeError):
    """A rank received a control message it cannot be expecting: the ranks no longer agree."""


class ControlError(RuntimeError):
    """A control broadcast failed: a rank is gone (gloo reports the closed connection)."""


def _store(ctx: RankContext, port: int, is_master: bool):
    import torch.distributed as dist

    return dist.TCPStore(ctx.store_host, port, ctx.world_size if is_master else None, is_master,
                         timeout=datetime.timedelta(seconds=ctx.collective_timeout_s),
                         wait_for_workers=False)
