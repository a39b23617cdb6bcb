"""Jobs, the bounded queue that batches compatible jobs, cancellation and timeouts.

A *job* is one HTTP request: `n` images or one video, each image one `GenerationRequest` item. The
worker thread takes a *batch*: the oldest waiting job plus, where the batcher says a batch pays at that
size (`xstage_dit.server.batching`), the following jobs whose items have the same `batch_key` (kind, size,
steps, guidance, frames, CFG settings), up to `max_batch_size` items, so they run as one pipeline call
with a list of prompts and one generator per item. Where it does not pay, the oldest job runs alone, at
once (no batch wait), its images one pipeline call each (`Batch.one_at_a_time`).

Everything here is thread-safe: HTTP handlers (asyncio thread) submit, cancel and subscribe; the worker
thread takes batches and reports steps; subscribers are asyncio queues fed with
`loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from xstage_dit.runtime.generation import GenerationRequest

QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED = "queued", "in_progress", "completed", "failed", "cancelled"
TERMINAL = (COMPLETED, FAILED, CANCELLED)


class QueueFull(Exception):
    """The queue holds `max_queue` jobs: answer 429 with `Retry-After: retry_after_s`."""

    def __init__(self, depth: int, retry_after_s: int):
        super().__init__(f"queue full ({depth} jobs waiting); retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class Unavailable(Exception):
    """The server cannot run jobs (loading, or a rank failed): answer 503."""


_ids = itertools.count()


def new_job_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(6)}{next(_ids):x}"


@dataclass(eq=False)
class Job:
    """One request. `results` holds PNG bytes per image, or one MP4, once `status` is completed."""

    id: str
    items: list[GenerationRequest]
    deadline: float
    created: float = field(default_factory=time.time)
    status: str = QUEUED
    steps_done: int = 0
    steps_total: int = 0
    started: float | None = None
    finished: float | None = None
    results: list[bytes] = field(default_factory=list)
    error: str | None = None
    error_code: int | None = None
    batch_size: int = 0
    step_times: list[float] = field(default_factory=list)
    pipeline_s: float | None = None  # the batch's pipeline call alone (prompt encoding to decoded pixels)
    encode_s: float | None = None  # PNG/MP4 encoding of the batch's outputs
    gc_s: float | None = None  # Python garbage-collection pauses (any thread) during the pipeline call
    encoding: Any = None  # image jobs: the `media.ImageEncoding` of their outputs (None: PNG)
    partial_images: int = 0  # image jobs: decoded previews a stream asked for (`server.previews`)
    cache_stats: dict | None = None  # its step cache's counts over its calls (`features.step_cache`), or None
    cancel_requested: bool = False
    _subscribers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, bool]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if not self.items:
            raise ValueError("expected at least one item in a job, got none")
        self.steps_total = self.items[0].steps

    @property
    def kind(self) -> str:
        return self.items[0].kind

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    def snapshot(self) -> dict[str, Any]:
        """Progress/status as one event dict (what SSE subscribers receive)."""
        event = {"job_id": self.id, "status": self.status, "steps_done": self.steps_done,
                 "steps_total": self.steps_total}
        if self.error:
            event["error"] = self.error
            event["code"] = self.error_code
        return event

    def timings(self) -> dict[str, float | None]:
        queued = (self.started or self.finished or time.time()) - self.created
        run = (self.finished - self.started) if (self.finished and self.started) else None
        total = (self.finished - self.created) if self.finished else None
        mean_step = sum(self.step_times) / len(self.step_times) if self.step_times else None
        if mean_step is None and run is not None and self.steps_done:
            # One step: its only interval also holds prompt encoding and decoding, the best bound there is.
            mean_step = run / self.steps_done
        return {"queued_s": queued, "run_s": run, "total_s": total, "mean_step_s": mean_step,
                "pipeline_s": self.pipeline_s, "encode_s": self.encode_s, "gc_s": self.gc_s,
                "step_cache": self.cache_stats}

    # --- subscribers (asyncio side) ---
    def subscribe(self, progress: bool = True) -> asyncio.Queue:
        """An asyncio queue receiving this job's events, starting with the current state. progress=False: only
        the state now and the final event (a request that answers once does not need a wake-up of the HTTP
        thread per step: each one takes the GIL from a host-bound worker thread)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            q.put_nowait(self.snapshot())
            if not self.done:
                self._subscribers.append((loop, q, progress))
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        with self._lock:
            self._subscribers = [sub for sub in self._subscribers if sub[1] is not q]

    def _publish(self) -> None:
        with self._lock:
            done = self.done
            subs = [(loop, q) for loop, q, progress in self._subscribers if progress or done]
            if done:
                self._subscribers.clear()
        if not subs:
            return
        event = self.snapshot()
        for loop, q in subs:
            try:
                loop.call_soon_threadsafe(q.put_nowait, event)
            except RuntimeError:  # the subscriber's loop has closed (client gone, server stopping)
                pass

    def publish_event(self, event: dict[str, Any]) -> None:
        """Hand `event` (a partial image, `server.previews`) to the subscribers that follow progress, in order with
        the step events (the same queues)."""
        with self._lock:
            subs = [(loop, q) for loop, q, progress in self._subscribers if progress]
        for loop, q in subs:
            try:
                loop.call_soon_threadsafe(q.put_nowait, event)
            except RuntimeError:  # the subscriber's loop has closed
                pass

    # --- state transitions (any thread; the queue's lock serialises them) ---
    def _finish(self, status: str, *, error: str | None = None, code: int | None = None) -> bool:
        if self.done:
            return False
        self.status, self.error, self.error_code = status, error, code
        self.finished = time.time()
        self._publish()
        return True


class Batch:
    """Jobs running in one pipeline call; `items[i]` belongs to `owners[i]`. one_at_a_time: run the items
    as one pipeline call per image (the batcher found batched images differ, or no gain, at this size)."""

    def __init__(self, jobs: list[Job], one_at_a_time: bool = False):
        self.jobs = jobs
        self.one_at_a_time = one_at_a_time
        self.items = [item for job in jobs for item in job.items]
        self.owners = [job for job in jobs for _ in job.items]

    @property
    def key(self) -> tuple:
        return self.items[0].batch_key

    @property
    def size(self) -> int:
        return len(self.items)


def _cache_of(job: Job, owners: list, calls: list) -> dict | None:
    """The step-cache counts of `job`'s calls added up: its items' calls (a call whose items are all its own)."""
    total, row = None, 0
    for count, stats in calls:
        mine = owners[row:row + count]
        row += count
        if stats is None or not mine or any(owner is not job for owner in mine):
            continue
        if total is None:
            total = dict(stats)
        else:
            total["computed"] += stats["computed"]
            total["skipped"] += stats["skipped"]
    return total


class JobQueue:
    """Bounded FIFO of waiting jobs with batching, cancellation, timeouts and a store of recent jobs.

    max_queue: waiting jobs allowed (running ones do not count); more gives `QueueFull`.
    max_batch_size: items per batch (a single job larger than this still runs, alone).
    batch_wait_s: after the first job of a batch is found, wait this long for compatible ones (only
        where the batcher batches).
    batcher: a `Batcher` deciding per size whether to batch (None: batch every compatible job).
    """

    def __init__(self, max_queue: int, max_batch_size: int, batch_wait_s: float = 0.0,
                 job_ttl_s: float = 3600.0, max_stored_jobs: int = 256, metrics: Any = None,
                 batcher: Any = None):
        if max_queue < 1 or max_batch_size < 1:
            raise ValueError(f"expected max_queue >= 1 and max_batch_size >= 1, got {max_queue}, {max_batch_size}")
        self.max_queue = max_queue
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.job_ttl_s = job_ttl_s
        self.max_stored_jobs = max_stored_jobs
        self.metrics = metrics
        self.batcher = batcher
        self._cond = threading.Condition()
        self._pending: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._jobs: dict[str, Job] = {}
        self._closed_reason: str | None = None
        self._batch_seconds_ewma: float | None = None

    # --- introspection ---
    @property
    def depth(self) -> int:
        with self._cond:
            return len(self._pending)

    @property
    def running(self) -> int:
        with self._cond:
            return len(self._running)

    def get(self, job_id: str) -> Job | None:
        with self._cond:
            return self._jobs.get(job_id)

    def retry_after_s(self) -> int:
        """Seconds until a slot likely frees: waiting batches x recent batch time (at least 1)."""
        with self._cond:
            return self._retry_after_locked()

    # --- submit / cancel (HTTP side) ---
    def submit(self, job: Job) -> Job:
        with self._cond:
            if self._closed_reason is not None:
                raise Unavailable(self._closed_reason)
            if len(self._pending) >= self.max_queue:
                depth = len(self._pending)
                retry = self._retry_after_locked()
                raise QueueFull(depth, retry)
            self._prune_locked()
            self._pending.append(job)
            self._jobs[job.id] = job
            self._cond.notify_all()
        self._gauge()
        return job

    def _retry_after_locked(self) -> int:
        per_batch = self._batch_seconds_ewma or 1.0
        batches = -(-(len(self._pending) + 1) // self.max_batch_size)
        return max(1, int(round(per_batch * batches)))

    def cancel(self, job_id: str) -> Job | None:
        """Cancel a job: a waiting one at once (its slot frees), a running one at its next step."""
        with self._cond:
            job = self._jobs.get(job_id)
            if job is None or job.done:
                return job
            if job.status == QUEUED:
                self._pending.remove(job)
                self._count(499)
                job._finish(CANCELLED, error="cancelled by the client", code=499)
                self._cond.notify_all()
            else:
                job.cancel_requested = True
        self._gauge()
        return job

    def delete(self, job_id: str) -> Job | None:
        """Forget a finished job (its outputs go with it); a job still waiting or running stays. Returns the job."""
        with self._cond:
            job = self._jobs.get(job_id)
            if job is not None and job.done:
                del self._jobs[job_id]
            return job

    # --- worker side ---
    def next_batch(self, timeout_s: float) -> Batch | None:
        """Wait up to `timeout_s` for work; return the next batch (jobs marked running) or None."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._expire_locked()
                if self._closed_reason is not None:
                    return None
                if self._pending:
                    break
                remaining = end - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(min(remaining, 0.5))
            first = self._pending[0]
            limit = self._limit(first)
            if self.batch_wait_s > 0 and limit > 1 and self._fill(first) < limit:
                # Give concurrent compatible requests a moment to arrive; returns early when full.
                wait_end = time.monotonic() + self.batch_wait_s
                while self._fill(first) < limit:
                    remaining = wait_end - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                if first not in self._pending:  # cancelled or expired while we waited
                    return self.next_batch(max(0.0, end - time.monotonic()))
            waiting = self._fill(first) - len(first.items)
            jobs = self._take_compatible(first, limit)
            now = time.time()
            for job in jobs:
                job.status, job.started, job.batch_size = RUNNING, now, sum(len(j.items) for j in jobs)
                self._running.append(job)
            self._cond.notify_all()
        for job in jobs:
            job._publish()
        self._gauge()
        if self.metrics is not None:
            outcome = "batched" if len(jobs) > 1 else ("fifo" if waiting > 0 else "single")
            self.metrics.batch_decisions.labels(outcome).inc()
        return Batch(jobs, one_at_a_time=limit == 1 and len(first.items) > 1)

    def _limit(self, first: Job) -> int:
        if self.batcher is None:
            return self.max_batch_size
        return min(self.max_batch_size, self.batcher.limit(first.items[0].batch_key))

    def _fill(self, first: Job) -> int:
        return sum(len(j.items) for j in self._pending if j.items[0].batch_key == first.items[0].batch_key)

    def _take_compatible(self, first: Job, limit: int) -> list[Job]:
        key, jobs, count = first.items[0].batch_key, [first], len(first.items)
        for job in list(self._pending)[1:] if limit > 1 else []:
            if job.items[0].batch_key == key and count + len(job.items) <= limit:
                jobs.append(job)
                count += len(job.items)
        for job in jobs:
            self._pending.remove(job)
        return jobs

    def step(self, batch: Batch, steps_done: int, steps_total: int, step_s: float | list | None) -> bool:
        """Record progress (steps_done: steps the device finished) and the durations of newly finished steps
        (a float, a list of them, or None); apply cancellations and timeouts. False: no job wants the rest."""
        now = time.time()
        step_times = [] if step_s is None else [step_s] if isinstance(step_s, (int, float)) else list(step_s)
        alive = False
        with self._cond:
            for job in batch.jobs:
                if job.done:
                    continue
                job.steps_done, job.steps_total = steps_done, steps_total
                job.step_times.extend(step_times)
                if job.cancel_requested:
                    self._end_running_locked(job, CANCELLED, "cancelled by the client", 499)
                elif now > job.deadline:
                    self._end_running_locked(job, FAILED, "request timed out", 504)
                else:
                    alive = True
                    job._publish()
        return alive

    def complete(self, batch: Batch, outputs: list[bytes], run_s: float, encode_s: float | None = None,
                 gc_s: float | None = None, cache: list | None = None) -> None:
        """Hand each job its outputs (`outputs[i]` for `batch.items[i]`); run_s: the pipeline call's seconds,
        encode_s: the encoding's, gc_s: garbage-collection pauses during the call, cache: (items, step-cache
        counts) per pipeline call in item order (`RunResult.cache`), summed per job (all shown in its timings)."""
        if len(outputs) != batch.size:
            raise ValueError(f"expected {batch.size} outputs for the batch, got {len(outputs)}")
        with self._cond:
            self._batch_seconds_ewma = run_s if self._batch_seconds_ewma is None else (
                0.7 * self._batch_seconds_ewma + 0.3 * run_s)
            for job in batch.jobs:
                if job.done:
                    continue
                job.results = [out for out, owner in zip(outputs, batch.owners) if owner is job]
                job.steps_done = job.steps_total
                job.pipeline_s, job.encode_s, job.gc_s = run_s, encode_s, gc_s
                job.cache_stats = _cache_of(job, batch.owners, cache or [])
                self._end_running_locked(job, COMPLETED, None, None)
        self._gauge()

    def fail_batch(self, batch: Batch, message: str, code: int = 500) -> None:
        with self._cond:
            for job in batch.jobs:
                if not job.done:
                    self._end_running_locked(job, FAILED, message, code)
                elif job in self._running:
                    self._running.remove(job)
        self._gauge()

    def release(self, batch: Batch) -> None:
        """The worker is done with `batch` (every job already ended, e.g. all cancelled)."""
        with self._cond:
            for job in batch.jobs:
                if job in self._running:
                    self._running.remove(job)
            self._cond.notify_all()
        self._gauge()

    def close(self, reason: str, code: int = 503) -> None:
        """Refuse new jobs and fail every waiting and running one with `code` (a rank failed)."""
        with self._cond:
            self._closed_reason = reason
            for job in list(self._pending) + list(self._running):
                job._finish(FAILED, error=reason, code=code)
            self._pending.clear()
            self._running.clear()
            self._cond.notify_all()
        self._gauge()

    def _count(self, code: int | None) -> None:
        if self.metrics is not None and code in (499, 504):
            self.metrics.errors.labels("cancelled" if code == 499 else "timeout").inc()

    def _end_running_locked(self, job: Job, status: str, error: str | None, code: int | None) -> None:
        self._count(code)
        job._finish(status, error=error, code=code)
        if job in self._running:
            self._running.remove(job)
        self._cond.notify_all()

    def _expire_locked(self) -> None:
        now = time.time()
        for job in [j for j in self._pending if now > j.deadline]:
            self._pending.remove(job)
            self._count(504)
            job._finish(FAILED, error="request timed out while queued", code=504)

    def _prune_locked(self) -> None:
        now = time.time()
        finished = sorted((j for j in self._jobs.values() if j.done), key=lambda j: j.finished or 0)
        excess = len(self._jobs) - self.max_stored_jobs + 1
        for job in finished:
            if excess > 0 or now - (job.finished or now) > self.job_ttl_s:
                del self._jobs[job.id]
                excess -= 1

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(self.depth)
            self.metrics.running_jobs.set(self.running)

    def jobs(self) -> Iterable[Job]:
        with self._cond:
            return list(self._jobs.values())
