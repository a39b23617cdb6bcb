"""What a failed batch answers: `failure_answer` turns the error a rank reported ("Kind: message", or rank 0's
"rank R: Kind: message" for a peer's) into the job's message and HTTP status.

- an adapter error (`features.lora`: unknown 404, bad file or shapes 400, too many / out of range 400, does not
  fit 507) keeps its own status and message;
- a step cache whose state would not fit (`features.step_cache.config.StepCacheMemory`) is 507 with its message;
- out of memory (`runtime.memory.GenerationOutOfMemory`, on any rank) is 507 with the message naming the request's
  size, frames, images and adapters (no allocator internals: the runner wrote it);
- anything else is 500 "generation failed: ...", as before.
"""

from __future__ import annotations

import re

from xstage_dit.features.lora.config import ADAPTER_ERRORS
from xstage_dit.features.step_cache.config import StepCacheMemory
from xstage_dit.runtime.memory import GenerationOutOfMemory

__all__ = ["failure_answer"]

_STATUS = {**{name: cls.status for name, cls in ADAPTER_ERRORS.items()},
           GenerationOutOfMemory.__name__: GenerationOutOfMemory.status,
           StepCacheMemory.__name__: StepCacheMemory.status}
_KIND = re.compile(r"^(?:rank (\d+): )?(\w+): (.*)$", re.DOTALL)


def failure_answer(error: str | None) -> tuple[str, int]:
    """(message, status) of the jobs of a batch that failed with `error` (see the module docstring)."""
    match = _KIND.match(error or "")
    if match is not None and match.group(2) in _STATUS:
        rank, kind, message = match.groups()
        where = f" (rank {rank})" if rank is not None and kind == GenerationOutOfMemory.__name__ else ""
        return message + where, _STATUS[kind]
    return f"generation failed: {error}", 500
