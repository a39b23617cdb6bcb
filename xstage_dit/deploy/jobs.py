"""A replica's job queue: the server's `JobQueue`, plus the video jobs of the other replicas held as copies, and the
request scope that tells the ingress which jobs a request submitted and which directory writes its answer waits for.

- `MirroredQueue` is the queue of the replica's `Worker` (its batching, timeouts and store unchanged). A video job
  submitted here is handed to the replica's `deploy.mirror.Mirror`, which pushes its state to the shared directory.
  A video job of another replica that a request names is *held* here as a `HeldJob` (`hold`): the server's
  handlers find it like any other job (state, events, content, listing), and a cancel or delete of it goes to its
  owner through the directory instead of touching this queue.
- `HeldJob` is such a copy: a `Job` whose state is set from the owner's records (`apply`), publishing to its
  subscribers as the owner's job does, so the server's event streams follow it unchanged.
- `RequestScope`: one per HTTP request (a context variable the ingress sets, `deploy.ingress`): the jobs the
  request submitted (a 503 of a request none of whose jobs started may be retried on another replica) and the
  directory writes its answer must wait for (a new job's registration, a delete), so that the next request,
  whichever replica it reaches, already sees them.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
from dataclasses import dataclass, field
from typing import Any, Awaitable

from xstage_dit.server.job_queue import COMPLETED, TERMINAL, Job, JobQueue

#: The state fields of a job that travel in a record (beside ``id`` and ``seq``).
RECORD_FIELDS = ("status", "steps_done", "steps_total", "created", "started", "finished", "error", "error_code",
                 "batch_size", "step_times", "pipeline_s", "encode_s", "gc_s", "cache_stats")


def record(job: Job, seq: int) -> dict:
    """The state of `job` as the directory keeps it: `RECORD_FIELDS`, its id and `seq` (grows with each change)."""
    out = {name: getattr(job, name) for name in RECORD_FIELDS}
    out["step_times"] = list(job.step_times)
    out.update(id=job.id, seq=seq)
    return out


@dataclass
class RequestScope:
    """What one HTTP request did to the queue (module docstring)."""

    jobs: list[Job] = field(default_factory=list)
    pending: list[Awaitable] = field(default_factory=list)

    def never_started(self) -> bool:
        """True when none of the request's jobs started (also when it submitted none)."""
        return all(job.started is None for job in self.jobs)

    async def settle(self, timeout_s: float) -> None:
        """Wait (up to `timeout_s`) for the directory writes this request made."""
        pending, self.pending = self.pending, []
        if pending:
            await asyncio.wait([asyncio.ensure_future(p) for p in pending], timeout=timeout_s)


_scope: contextvars.ContextVar[RequestScope | None] = contextvars.ContextVar("xstage_request_scope", default=None)


def open_scope() -> tuple[RequestScope, contextvars.Token]:
    scope = RequestScope()
    return scope, _scope.set(scope)


def close_scope(token: contextvars.Token) -> None:
    _scope.reset(token)


def current_scope() -> RequestScope | None:
    return _scope.get()


@dataclass(eq=False)
class HeldJob(Job):
    """Another replica's video job, as this replica answers for it (module docstring). ``seq``: of the last record
    applied; ``owner``: the replica running it."""

    seq: int = -1
    owner: str = ""

    @classmethod
    def from_view(cls, view: dict) -> "HeldJob":
        """From the directory's `get` of the job (its items and record)."""
        rec = view["record"]
        job = cls(id=rec["id"], items=view["items"], deadline=math.inf, created=rec["created"], owner=view["owner"])
        job.apply(rec, view["owner"])
        return job

    def apply(self, rec: dict, owner: str | None = None) -> None:
        """Take the owner's record `rec` (an older one than the last applied is ignored) and tell the subscribers."""
        if rec.get("seq", 0) <= self.seq:
            return
        with self._lock:
            for name in RECORD_FIELDS:
                value = rec[name]
                setattr(self, name, list(value) if name == "step_times" else value)
            self.seq, self.owner = rec.get("seq", 0), owner or self.owner
        self._publish()

    def end(self, status: str, error: str, code: int) -> None:
        """End this copy with no record from the owner (the job was deleted, or its owner is gone)."""
        self._finish(status, error=error, code=code)


class MirroredQueue(JobQueue):
    """The replica's queue (module docstring). mirror: the replica's `deploy.mirror.Mirror` (set before the worker
    starts); JobQueue's arguments otherwise."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.mirror: Any = None

    def submit(self, job: Job) -> Job:
        scope = current_scope()
        if scope is not None:
            scope.jobs.append(job)
        job = super().submit(job)
        if job.kind == "video" and self.mirror is not None:
            self.mirror.track(job)
        return job

    def hold(self, job: HeldJob) -> HeldJob:
        """Keep another replica's job among this queue's (the copy already held is returned instead)."""
        with self._cond:
            held = self._jobs.get(job.id)
            if isinstance(held, HeldJob):
                return held
            if held is not None:
                raise ValueError(f"expected a job of another replica, got {job.id!r}, which runs here")
            self._prune_locked()
            self._jobs[job.id] = job
            return job

    def own_jobs(self) -> list[Job]:
        """The jobs submitted here (not the held copies)."""
        return [job for job in self.jobs() if not isinstance(job, HeldJob)]

    def cancel(self, job_id: str) -> Job | None:
        job = self.get(job_id)
        if isinstance(job, HeldJob):
            if not job.done and self.mirror is not None:
                self.mirror.cancel_elsewhere(job_id)
            return job
        return super().cancel(job_id)

    def delete(self, job_id: str) -> Job | None:
        """Forget an ended job here and, for a video job, everywhere (the directory tells its owner)."""
        job = super().delete(job_id)
        if job is not None and job.done and job.kind == "video" and self.mirror is not None:
            self.mirror.forget_everywhere(job_id)
        return job

    def drop(self, job_id: str) -> Job | None:
        """Forget a job here only (the owner's side of a delete made elsewhere, or a copy gone from the directory)."""
        job = self.get(job_id)
        if isinstance(job, HeldJob) and not job.done:
            job.end("failed", "deleted on another replica", 404)
        return JobQueue.delete(self, job_id)

    def idle(self) -> bool:
        """No job of this replica waits or runs (held copies do not count): what a draining replica waits for."""
        return all(job.done for job in self.own_jobs())


__all__ = ["COMPLETED", "TERMINAL", "HeldJob", "MirroredQueue", "RequestScope", "close_scope", "current_scope",
           "open_scope", "record"]
