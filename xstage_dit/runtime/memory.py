"""Out of memory during a generation: what it becomes (`GenerationOutOfMemory`, the server's 507) and what is
freed before anyone sees it.

torch's ``OutOfMemoryError`` text names allocator internals (reserved / allocated bytes, other processes' ids,
``PYTORCH_CUDA_ALLOC_CONF`` advice): nothing a client can act on, and more about the machine than it should learn.
`refuse_out_of_memory` runs a call and, when it ran out of memory (here, or on a peer rank: a ``RankFailed`` whose
first failure was an ``OutOfMemoryError``), lets the exception and its traceback go (their frames hold the
call's activations), collects garbage, empties the CUDA cache, and raises `GenerationOutOfMemory` naming what the
request asked for (size, frames, images, adapters): what the client can make smaller.

    pixels = refuse_out_of_memory(lambda: pipe(**kwargs), items, device)
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Sequence

import torch

__all__ = ["GenerationOutOfMemory", "describe_items", "free_memory", "is_out_of_memory", "refuse_out_of_memory"]

_OOM_NAMES = ("OutOfMemoryError", "GenerationOutOfMemory", "AdapterMemory")


class GenerationOutOfMemory(RuntimeError):
    """A request did not fit in the device's memory (answered 507: the server is fine, the request too large)."""

    status = 507


def is_out_of_memory(exc: BaseException) -> bool:
    """True for torch's ``OutOfMemoryError`` and for a peer rank's failure that was one (`comm.agreement.RankFailed`
    carries the first failing rank's exception type name in its message)."""
    if isinstance(exc, (torch.OutOfMemoryError, GenerationOutOfMemory)):
        return True
    text = str(exc)
    return type(exc).__name__.startswith("RankFailed") and any(f": {name}: " in text for name in _OOM_NAMES)


def describe_items(items: Sequence[Any]) -> str:
    """What a batch of `GenerationRequest` asked for, in a client's terms: "1024x1024, 81 frames, 4 images,
    LoRA style:0.8"."""
    first = items[0]
    parts = [f"{first.width}x{first.height}"]
    if first.kind == "video":
        parts.append(f"{first.num_frames} frames")
    count = sum(item.n for item in items)
    parts.append(f"{count} {'image' if first.kind == 'image' else 'video'}{'s' if count != 1 else ''}")
    lora = getattr(first, "lora", ())
    if lora:
        parts.append("LoRA " + ", ".join(f"{name}:{scale:g}" for name, scale in lora))
    return ", ".join(parts)


def free_memory(device: torch.device | str) -> None:
    """Collect garbage, then give the CUDA caching allocator's free blocks back (what a failed call took)."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def refuse_out_of_memory(call: Callable[[], Any], items: Sequence[Any], device: torch.device | str) -> Any:
    """``call()``; when it runs out of memory, free what it took and raise `GenerationOutOfMemory` naming `items`."""
    failed = None
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - only an out-of-memory is turned into a refusal; the rest goes on
        if not is_out_of_memory(exc):
            raise
        failed = type(exc).__name__
    # Outside the except block: the exception, its traceback and the frames holding the call's tensors are gone.
    free_memory(device)
    raise GenerationOutOfMemory(f"out of memory on {torch.device(device).type}: the request ({describe_items(items)}) "
                                f"needs more device memory than is free now; ask for a smaller size, fewer frames or "
                                f"images, or fewer adapters ({failed})")
