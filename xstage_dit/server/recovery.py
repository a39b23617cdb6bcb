"""A forward that failed on one rank at world > 1 (out of memory on one GPU) leaves the ranks' process groups
with a collective the failed rank never joined: the next request would pair collectives wrongly or hang. The
failing rank published its error (`comm.agreement.publish_failure`) and every peer stopped at once with it; then
`Recovery` runs on every rank, in the same batch:

1. all ranks meet on the store (which works when the groups do not) and the published failure is cleared
   (`agreement.clear_failure_together`); the barrier watchdog forgets it;
2. each rank undoes its engine's stack and applies it again: new sequence / CFG groups, new communication
   buffers (the old ones, and their abandoned collective, are dropped), the same weights, the preloaded adapters.

The server stays ready, and the next request is computed as before the failure (the same stack on the same
weights: the same bytes; compiled graphs are compiled again). The failed request's answer is the failure's own
(507 for out of memory, `server.failures`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from xstage_dit.comm import watchdog
from xstage_dit.comm.agreement import clear_failure_together, published_failure

log = logging.getLogger(__name__)

__all__ = ["Recovery"]


class Recovery:
    """Rebuilds `loaded`'s engine stack after a published forward failure (module docstring). ``adapters``: the LoRA
    manager of the stack now (a new one after a recovery)."""

    def __init__(self, loaded: Any, kind: str, timeout_s: float = 60.0) -> None:
        self.loaded, self.kind, self.timeout_s = loaded, kind, timeout_s
        self.generation = 0

    @property
    def adapters(self) -> Any:
        return self.loaded.adapters

    def maybe_recover(self) -> bool:
        """Every rank, after its call failed: rebuild when the failure was a published forward failure at world > 1
        (True), else nothing (False: the failure was this rank's alone and no collective was abandoned)."""
        if not dist.is_initialized() or dist.get_world_size() == 1 or published_failure() is None:
            return False
        started = time.perf_counter()
        clear_failure_together(self.generation, self.timeout_s)
        self.generation += 1
        watchdog.reset()
        engine = self.loaded.engine
        pipe = engine.pipe
        engine.restore()
        stack = engine.apply(pipe, kind=self.kind)
        self.loaded.adapters = stack.lora
        self.loaded.served = replace(self.loaded.served, lora=stack.lora)
        log.warning("recovered from a failed forward on another rank: process groups and the feature stack rebuilt "
                    "in %.2f s (recovery %d)", time.perf_counter() - started, self.generation)
        return True
