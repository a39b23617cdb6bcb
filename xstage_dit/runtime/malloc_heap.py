"""glibc's malloc told to keep freed memory mapped, so each answer's multi-megabyte buffers do not page-fault.

    report = keep_freed_memory()   # once, in a serving process: {"applied": True, "mmap_threshold": ..., ...}

Every image answer allocates a few buffers about the image's size: the PNG's filtered rows and its bytes, the
JSON's base64, the client's read of the body (3-12 MB each for 1024² to 2048²). glibc maps a block that large
afresh (``mmap`` at or above its mmap threshold: 128 KiB at first, raised only when a mapped block is freed) and
hands a heap top above its trim threshold back to the kernel, so a server that answers now and then touches fresh
pages on every request and faults once per 4 KiB. A PNG encoded on the main thread (where ``xstage-dit serve``'s
event loop writes the JSON answer) page-faults on every call without this and not once with it; on a worker
thread it does not fault either way (the timings: benchmarks/results/serving/NOTES.md, "glibc's malloc keeps
freed memory"; `tests/runtime/test_malloc_heap.py` holds the bound).

``keep_freed_memory()`` fixes the mmap threshold at 32 MiB (glibc's largest, half its 64 MiB arena heap on
64-bit) and the trim threshold at `TRIM_BYTES`: blocks under 32 MiB come from the heap, and up to `TRIM_BYTES`
of free memory at an arena's top stays mapped for the next request. The price is that resident memory: up to
`TRIM_BYTES` per malloc arena that held such buffers (a serving process uses a handful of threads). Blocks of 32
MiB and more (video frames, host copies of latents) are still mapped and unmapped as before.

It is process-wide and not undone on shutdown (glibc cannot restore its dynamic threshold). The server applies it
before its warm-up unless ``ServerConfig.keep_freed_memory`` is False; ``xstage-dit bench`` applies it at its start
where a served contender runs, so the bare and the served rows of one run allocate alike. On a C library other
than glibc it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["MMAP_THRESHOLD", "TRIM_BYTES", "keep_freed_memory"]

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20  # glibc accepts at most HEAP_MAX_SIZE / 2 = 32 MiB on 64-bit
TRIM_BYTES = 128 << 20  # free heap kept per arena: a few answers' buffers at 2048² RGBA (16 MB a PNG of noise)
_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, <malloc.h>
_M_MMAP_THRESHOLD = -3
_APPLIED: dict | None = None


def keep_freed_memory() -> dict:
    """Set glibc's mmap and trim thresholds (once per process); returns what was done, for the startup report.

    {"applied": bool, "mmap_threshold": bytes, "trim_threshold": bytes} or {"applied": False, "reason": str}."""
    global _APPLIED
    if _APPLIED is None:
        _APPLIED = _set_thresholds()
    return dict(_APPLIED)


def _set_thresholds() -> dict:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt, version = libc.mallopt, libc.gnu_get_libc_version
    except (OSError, AttributeError, TypeError):
        return {"applied": False, "reason": f"not glibc (C library {name!r}): malloc left as it is"}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    version.restype = ctypes.c_char_p
    # The mmap threshold first: glibc refuses one above its limit without touching anything, while the trim
    # threshold, once set, turns the dynamic thresholds off and would leave every image buffer mapped afresh.
    if not mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        reason = f"glibc {version().decode()} refused an mmap threshold of {MMAP_THRESHOLD} bytes: malloc left as it is"
        log.warning("%s", reason)
        return {"applied": False, "reason": reason}
    mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES)  # always accepted
    log.info("malloc keeps freed memory: blocks under %d MiB from the heap, %d MiB of free heap kept per arena",
             MMAP_THRESHOLD >> 20, TRIM_BYTES >> 20)
    return {"applied": True, "glibc": version().decode(), "mmap_threshold": MMAP_THRESHOLD,
            "trim_threshold": TRIM_BYTES}
