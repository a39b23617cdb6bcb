"""Shared helpers of the benchmark scripts: timing here; environment record and JSON + Markdown output
from `xstage_dit.bench.results` (re-exported).

Every result file has the same shape::

    {"benchmark": "flux-step", "environment": {...}, "summary": {...}, "rows": [{...}, ...]}

- ``environment()``: GPU name, driver, CUDA, torch / triton / diffusers / transformers versions, Python,
  host, git commit (``git rev-parse`` or ``$XSTAGE_GIT_COMMIT`` when the tree travels without ``.git``).
- ``time_ms(fn)``: median of per-call CUDA-event timings after warm-up (on a CPU: ``perf_counter``),
  with the spread, so a reader can tell a difference from noise.
- ``write_results(...)``: ``<stem>.json`` and ``<stem>.md`` (a Markdown table of the rows) in one call.
- ``profile_once(fn)``: one call under torch's profiler (host, and the GPU's kernels where there is one).
- ``checked_list(parser, text, parse)``: a comma-separated option's items, each checked by ``parse`` first.

Example::

    stats = time_ms(lambda: model(**inputs), warmup=3, reps=10)
    write_results("benchmarks/results/flux-step-h200", "flux-step", rows, summary, columns)
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

# The result writer lives in the package (an installed wheel benchmarks too); the scripts import it from here.
from xstage_dit.bench.results import environment, markdown_table, write_results  # noqa: F401


def time_ms(fn: Callable[[], Any], *, warmup: int = 3, reps: int = 10, device: str | torch.device | None = None
            ) -> dict[str, float]:
    """Time ``fn()``: ``warmup`` untimed calls, then ``reps`` calls each timed on its own.

    On CUDA each call sits between two events on the current stream (no host sync inside the loop);
    on a CPU ``perf_counter`` brackets each call. Returns milliseconds: median, min, max, p20, p80, reps.
    """
    if warmup < 0 or reps < 1:
        raise ValueError(f"expected warmup >= 0 and reps >= 1, got {warmup} and {reps}")
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    for _ in range(warmup):
        fn()
    times: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    ordered = sorted(times)

    def quantile(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {
        "median_ms": statistics.median(times),
        "min_ms": ordered[0],
        "max_ms": ordered[-1],
        "p20_ms": quantile(0.2),
        "p80_ms": quantile(0.8),
        "reps": reps,
    }


def interleaved_times(fns: dict[str, Callable[[], Any]], time_fn: Callable[[Callable[[], Any]], float], *,
                      rounds: int = 3, errors: dict[str, str] | None = None,
                      required: tuple[str, ...] = ()) -> dict[str, list[float]]:
    """Time several variants in ``rounds`` interleaved rounds: ``{name: [ms per round]}``.

    Timing variant A to completion and then variant B lets a drift of the GPU over the run (clocks,
    temperature) read as a difference between A and B. Here every round times every variant once
    (``time_fn(fn)`` -> ms, e.g. a median of CUDA events), forward in even rounds and backward in odd
    ones (A B C, C B A, ...): over an even number of rounds a linear drift gives every variant the same
    median over rounds.

    errors: where given, a variant whose timing raises is dropped from the rounds and from the result, its
    error recorded here (``{name: repr}``), and the others go on; a variant in ``required`` (the baseline a
    row is measured against) still raises. Without it, any error raises.
    """
    if rounds < 1:
        raise ValueError(f"expected rounds >= 1, got {rounds}")
    names = list(fns)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            if errors is not None and name in errors:
                continue
            try:
                out[name].append(float(time_fn(fns[name])))
            except Exception as exc:
                if errors is None or name in required:
                    raise
                errors[name] = repr(exc)[:400]
                out.pop(name)
    return out


def profile_once(fn: Callable[[], Any]):
    """One call of ``fn()`` under torch's profiler, in the calling thread (the profiler records the thread that starts
    it), CUDA activity included where a GPU is present, the GPU synchronized before it stops: the
    ``key_averages()`` of its events."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    return prof.key_averages()


def checked_list(parser, text: str, parse: Callable[[str], Any]) -> list[str]:
    """The items of a comma-separated option value (blanks dropped), after ``parse`` accepted each: its ValueError
    becomes ``parser.error`` (usage, the message, exit 2) before anything is built or measured."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    for item in items:
        try:
            parse(item)
        except ValueError as exc:
            parser.error(str(exc))
    return items
