"""Python's cyclic garbage collector in a serving process: frozen after warm-up, its pauses counted.

A full (generation 2) collection walks every object the collector tracks. With torch, diffusers and a
pipeline loaded that is hundreds of thousands of objects, and one ``gc.collect()`` of them is a pause of the
order of a whole short request (benchmarks/results/serving/NOTES.md, "The heap frozen after warm-up"). Every
thread stands still meanwhile (the collector holds the GIL), so a full collection that falls inside a request
costs that request the whole pause.

``freeze_heap()`` after warm-up (what vLLM does after its CUDA-graph capture) collects once, then moves
everything alive into the permanent generation, which collections skip: the modules, the imported
libraries, the compiled graphs. What requests allocate later is collected as before. ``unfreeze_heap()``
on shutdown hands those objects back to the collector (an in-process server must not pin its pipeline
for the rest of the process).

``GcPauses`` counts collections and their pause by generation, process-wide (a pause in any thread
stops every thread's Python): the worker reports the pauses inside each batch (``Timings.gc_s``) and
``/metrics`` exposes the totals (``xstage_gc_collections_total``, ``xstage_gc_pause_seconds_total``).
"""

from __future__ import annotations

import gc
import time

__all__ = ["GENERATIONS", "GcPauses", "freeze_heap", "unfreeze_heap"]

GENERATIONS = (0, 1, 2)


class GcPauses:
    """Collections and pause seconds per generation (index 0-2) since `install()`.

    Example::

        pauses = GcPauses().install()
        before = pauses.total_s()
        ...                                   # a batch
        gc_s = pauses.total_s() - before      # every collection's pause meanwhile, in any thread
        pauses.uninstall()
    """

    def __init__(self) -> None:
        self.collections = [0 for _ in GENERATIONS]
        self.seconds = [0.0 for _ in GENERATIONS]
        self._started: float | None = None

    def install(self) -> "GcPauses":
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        # Runs inside the collection with the GIL held: arithmetic only (no locks, no logging, no allocation
        # worth collecting).
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            generation = info["generation"]
            self.collections[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._started
            self._started = None

    def total_s(self) -> float:
        """Seconds spent in collections of every generation so far."""
        return sum(self.seconds)


def freeze_heap() -> dict:
    """Collect once, then move every object alive into the permanent generation (``gc.freeze``).

    Returns ``{"frozen_objects": n, "collect_s": seconds}``: what later collections skip, and what one full
    collection of it took just now (the pause a request would have paid)."""
    started = time.perf_counter()
    gc.collect()
    collect_s = time.perf_counter() - started
    gc.freeze()
    return {"frozen_objects": gc.get_freeze_count(), "collect_s": round(collect_s, 4)}


def unfreeze_heap() -> None:
    """Hand the frozen objects back to the collector (they join the oldest generation)."""
    gc.unfreeze()
