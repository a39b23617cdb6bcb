"""A replica's side of the shared job directory (`deploy.directory`): it pushes its own video jobs there, holds
copies of the other replicas' jobs that its requests name, carries out the commands the directory hands it, and
keeps its lease with a long poll.

Everything runs on the replica's event loop (the one its HTTP requests run on); the worker thread only changes
jobs, whose subscriptions (`Job.subscribe`) wake the push tasks here.

- Own jobs (`track`): one task per video job registers it (the request's answer waits for that: `RequestScope`),
  then pushes its record at every change it is told of (the latest state only, one write in flight per job), and
  its MP4 with the completed record.
- Other replicas' jobs (`resolve`): the directory's record becomes a `HeldJob` of the replica's queue, kept current
  by a watch task (the directory's long poll) until the job ends; its MP4 is fetched when a request asks for it.
- Commands (`run`, the poll loop): a cancel or a delete made through another replica, and requests for this
  replica's metrics; a poll also lists the jobs held here, so a recreated directory learns them again.

`DirectoryClient` calls the directory and survives its recreation: on a failed call it resolves the actor again
and retries, for up to `RETRY_S`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from xstage_dit.deploy.directory import POLL_S
from xstage_dit.deploy.jobs import COMPLETED, HeldJob, MirroredQueue, current_scope, record
from xstage_dit.server.job_queue import Job, JobQueue

log = logging.getLogger(__name__)

RETRY_S = 15.0  # how long a directory call is retried (the directory is being recreated) before it fails
SETTLE_S = 10.0  # how long an answer waits for its directory writes


class DirectoryClient:
    """Calls of the directory: ``await client.call("get", job_id)``. resolve: returns the directory (a Ray actor
    handle, whose methods are called as ``handle.m.remote(...)``; or, with ``local=True``, the `JobDirectory`
    itself, for tests)."""

    def __init__(self, resolve: Callable[[], Any], local: bool = False):
        self.resolve, self.local = resolve, local
        self._target: Any = None

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + RETRY_S
        while True:
            try:
                if self._target is None:
                    self._target = self.resolve()
                if self.local:
                    return await getattr(self._target, method)(*args, **kwargs)
                return await getattr(self._target, method).remote(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the directory is down or being recreated: resolve it again
                self._target = None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"job directory unreachable for {RETRY_S:.0f} s: {exc}") from exc
                await asyncio.sleep(0.2)


class Mirror:
    """One replica's link to the directory (module docstring).

    owner: this replica's id. queue: its `MirroredQueue` (this sets ``queue.mirror``). directory: a
    `DirectoryClient`. state: returns what the replica's poll reports (state, reason, ranks, queue...).
    metrics: returns this replica's Prometheus text (replica-labelled), for another replica's ``/metrics``."""

    def __init__(self, owner: str, queue: MirroredQueue, directory: DirectoryClient, state: Callable[[], dict],
                 metrics: Callable[[], Awaitable[str]]):
        self.owner, self.queue, self.directory, self.state, self.metrics = owner, queue, directory, state, metrics
        queue.mirror = self
        self.loop: asyncio.AbstractEventLoop | None = None
        self._pushes: dict[str, asyncio.Task] = {}
        self._watches: dict[str, asyncio.Task] = {}
        self._seq: dict[str, int] = {}
        self._stopped = asyncio.Event()
        self._wake = asyncio.Event()

    def start(self) -> asyncio.Task:
        """Start the poll loop on the running event loop (the replica's)."""
        self.loop = asyncio.get_running_loop()
        return self.loop.create_task(self.run(), name="xstage-directory-poll")

    def _spawn(self, coro: Awaitable) -> asyncio.Future:
        """Run `coro` on the replica's loop, from it or from another thread."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            return self.loop.create_task(coro)
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop), loop=self.loop)

    # ----- own jobs -----
    def track(self, job: Job) -> None:
        """Push `job` (a video job just submitted here) to the directory; the request's answer waits for its
        registration."""
        registered = self.loop.create_future()
        self._pushes[job.id] = self.loop.create_task(self._push(job, registered), name=f"xstage-push-{job.id}")
        scope = current_scope()
        if scope is not None:
            scope.pending.append(registered)

    def _next(self, job: Job) -> dict:
        self._seq[job.id] = self._seq.get(job.id, 0) + 1
        return record(job, self._seq[job.id])

    async def _register(self, job: Job) -> None:
        content = job.results[0] if job.status == COMPLETED and job.results else None
        await self.directory.call("register", self.owner, job.kind, job.items, self._next(job), content)

    async def _push(self, job: Job, registered: asyncio.Future) -> None:
        events = job.subscribe()
        try:
            try:
                await self._register(job)
            finally:
                registered.set_result(None)
            while True:
                await events.get()
                while not events.empty():  # only the latest state matters
                    events.get_nowait()
                done = job.done
                content = job.results[0] if job.status == COMPLETED and job.results else None
                if not await self.directory.call("update", self.owner, self._next(job), content):
                    if self.queue.get(job.id) is not job:
                        return  # deleted (through another replica): nothing left to push
                    await self._register(job)  # the directory was recreated
                if done:
                    return
        except Exception:  # noqa: BLE001 - the job runs on; other replicas see its last pushed state
            log.exception("pushing video job %s to the job directory failed", job.id)
        finally:
            job.unsubscribe(events)
            self._pushes.pop(job.id, None)

    async def flush(self, timeout_s: float) -> bool:
        """Wait (up to `timeout_s`) until every own job's last state is in the directory; False on timeout."""
        pending = list(self._pushes.values())
        if not pending:
            return True
        _, left = await asyncio.wait(pending, timeout=timeout_s)
        return not left

    def cancel_elsewhere(self, job_id: str) -> None:
        """A request here cancels another replica's job: its owner is told (its state comes back by the watch)."""
        self._spawn(self.directory.call("cancel", job_id))

    def forget_everywhere(self, job_id: str) -> None:
        """A request here deleted a video job: the directory forgets it and tells its owner; the answer waits."""
        done = self._spawn(self.directory.call("forget", job_id))
        scope = current_scope()
        if scope is not None:
            scope.pending.append(done)

    # ----- other replicas' jobs -----
    async def resolve(self, job_id: str, content: bool = False) -> None:
        """Before a request names `job_id`: when it is not a job of this replica, hold (or refresh) its copy from
        the directory, or drop the copy when the directory no longer has it. content: fetch its MP4 as well."""
        local = self.queue.get(job_id)
        if local is not None and not isinstance(local, HeldJob):
            return
        view = await self.directory.call("get", job_id)
        if view is None:
            if local is not None:
                self.queue.drop(job_id)
            return
        self._hold(view)
        held = self.queue.get(job_id)
        if content and held.status == COMPLETED and not held.results and view["has_content"]:
            data = await self.directory.call("content", job_id)
            if data is not None:
                held.results = [data]

    def _hold(self, view: dict) -> HeldJob:
        held = self.queue.hold(HeldJob.from_view(view))
        held.apply(view["record"], view["owner"])
        if not held.done and held.id not in self._watches:
            self._watches[held.id] = self.loop.create_task(self._watch(held), name=f"xstage-watch-{held.id}")
        return held

    async def _watch(self, held: HeldJob) -> None:
        try:
            while not held.done:
                view = await self.directory.call("watch", held.id, held.seq, POLL_S)
                if view is None:
                    held.end("failed", "deleted on another replica", 404)
                    self.queue.drop(held.id)
                    return
                held.apply(view["record"], view["owner"])
        except Exception:  # noqa: BLE001 - the copy stays as it was; the next request refreshes it
            log.exception("watching video job %s in the job directory failed", held.id)
        finally:
            self._watches.pop(held.id, None)

    async def sync(self, kind: str = "video") -> None:
        """Before a listing: hold every job of `kind` the directory has (but this replica's own), and drop the copies
        it no longer has."""
        held = {job.id: job for job in self.queue.jobs() if isinstance(job, HeldJob) and job.kind == kind}
        known = set()
        for view in await self.directory.call("listing", kind, list(held)):
            job_id = view["record"]["id"]
            known.add(job_id)
            if job_id in held:
                held[job_id].apply(view["record"], view["owner"])
            elif self.queue.get(job_id) is None:
                self._hold(view)
        for job_id in set(held) - known:
            self.queue.drop(job_id)

    # ----- the poll loop -----
    async def run(self) -> None:
        """Poll the directory until `stop`: carry out its commands, register again what it lacks."""
        while not self._stopped.is_set():
            # jobs still being pushed are not listed: their push task registers them
            held = [job.id for job in self.queue.own_jobs() if job.kind == "video" and job.id not in self._pushes]
            try:
                answer = await self.directory.call("poll", self.owner, self.state(), held, POLL_S)
            except Exception:  # noqa: BLE001 - the client retried for RETRY_S already: keep trying, slower
                log.exception("polling the job directory failed")
                await asyncio.sleep(1.0)
                continue
            for verb, arg in answer["commands"]:
                self._command(verb, arg)
            for job_id in answer["missing"]:
                job = self.queue.get(job_id)
                if job is not None and job_id not in self._pushes:
                    self._pushes[job_id] = self.loop.create_task(self._register_again(job))
            if answer["missing"]:
                await asyncio.sleep(0.1)  # the answer came at once: let the registrations go first

    async def _register_again(self, job: Job) -> None:
        try:
            await self._register(job)
        except Exception:  # noqa: BLE001 - named missing again at the next poll
            log.exception("registering video job %s again failed", job.id)
        finally:
            self._pushes.pop(job.id, None)

    def _command(self, verb: str, arg: str) -> None:
        if verb == "cancel":
            JobQueue.cancel(self.queue, arg)  # this replica's own job, cancelled here
        elif verb == "forget":
            self.queue.drop(arg)
        elif verb == "metrics":
            self._spawn(self._report_metrics(arg))
        else:
            log.error("unknown job directory command %r", verb)

    async def _report_metrics(self, token: str) -> None:
        await self.directory.call("report_metrics", self.owner, token, await self.metrics())

    async def report_state(self) -> None:
        """Tell the directory this replica's state now (it changed: an engine failure), not at the next poll."""
        await self.directory.call("report", self.owner, self.state())

    async def stop(self) -> None:
        """Leave the directory (the replica drained): no more polls, its lease ends now."""
        self._stopped.set()
        for task in list(self._watches.values()):
            task.cancel()
        await self.directory.call("leave", self.owner)
