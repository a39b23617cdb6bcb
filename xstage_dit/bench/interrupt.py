"""A bench cut short by SIGTERM writes the row it was measuring before it stops.

    with row_on_sigterm(report, contender):
        row, output = measure(b, contender, reference)

Why: a device call ends with ``timeout``'s SIGTERM, and a row still compiling then left nothing in the results:
three FP8 rows on an H100 (2026-12-06) ran 100-400 s each and were lost without a word of how far they got. The
row written here ("interrupted") says how long it ran, how many frames Dynamo converted meanwhile (per-block
recompiles against one slow compile) and how the finished graphs' compile time split into phases; the run's files
are complete up to it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Iterator

from xstage_dit._torch_private import compile_seconds, compile_seconds_since, frames_converted
from xstage_dit.bench.measure import unmeasured_row

__all__ = ["Stopped", "row_on_sigterm"]


class Stopped(BaseException):
    """SIGTERM arrived while a row was measured (a BaseException: a contender's ``except Exception`` must not
    swallow it and go on)."""


@contextlib.contextmanager
def row_on_sigterm(report, contender) -> Iterator[None]:
    """While the block runs, SIGTERM puts an "interrupted" row for `contender` into `report` (which rewrites the
    files) and raises `Stopped`. Only the main thread can take signals; elsewhere the block runs unguarded."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    started, frames, compiled = time.perf_counter(), frames_converted(), compile_seconds()

    def stop(signum, frame):
        elapsed = time.perf_counter() - started
        converted = frames_converted() - frames
        reason = f"stopped by SIGTERM after {elapsed:.0f} s of this row ({converted} Dynamo frames converted meanwhile)"
        report.put(dict(unmeasured_row(contender, "interrupted", reason), interrupted_after_s=elapsed,
                        dynamo_frames_so_far=converted,
                        # phases of the graphs finished meanwhile (the one compiling now is not counted yet)
                        compile_s_so_far=compile_seconds_since(compiled)))
        raise Stopped(f"SIGTERM during {contender.name}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
