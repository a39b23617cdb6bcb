"""The job directory every replica of a Ray Serve deployment shares: the video jobs of all replicas, their state
and their MP4s, the replicas' own state, and the commands (cancel, forget, report metrics) waiting for a replica.

Why a directory and not "ask the replica that owns the job": an HTTP request reaches whichever replica Serve's
router picks, and a replica is not addressable by itself (only its deployment is). So the replica running a video
job (its *owner*) pushes the job's state to the directory at every change, and its MP4 when it completes
(`deploy.mirror`); any other replica answers a poll, a stream or a download from the directory. The directory is
a Serve *deployment-scoped actor* (``deployment_actors`` of the deployment, Ray 2.60): one instance, started and
health-checked by Serve's controller, deleted with the application, recreated after a failure. A recreated
directory starts empty and fills again within a poll: every owner's poll lists the jobs it holds, and the
directory answers with those it does not know, which the owner registers again (content included).

Owners poll the directory (`poll`, a long poll of `POLL_S`): the answer carries the commands for them (a cancel
or a delete made through another replica, a metrics report), and each poll is the owner's lease. An owner not
seen for `owner_lost_s` (its process died) is dropped, and its jobs that had not ended fail with 503, so no job
waits for a replica that is gone.

Records are plain dicts (`record` of `deploy.mirror`): status, steps, times, error and code, and ``seq``, which
grows with every change (an older record never replaces a newer one). Plain Python and asyncio: the tests drive it
without Ray; Ray wraps it with ``ray.remote`` for the deployment.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, Callable

TERMINAL = ("completed", "failed", "cancelled")
POLL_S = 2.0  # an owner's long poll returns at most this late


def _lost(record: dict, owner: str, now: float) -> dict:
    return {**record, "status": "failed", "error": f"server unavailable: replica {owner} stopped before the job "
                                                   f"ended", "error_code": 503, "finished": now,
            "seq": record.get("seq", 0) + 1}


class JobDirectory:
    """The shared directory (module docstring). job_ttl_s / max_stored_jobs: as the servers' `ServerConfig`: an
    ended job is kept this long, and no more than this many jobs are kept. owner_lost_s: a replica not polling for
    this long is gone. clock: seconds (tests pass their own)."""

    def __init__(self, job_ttl_s: float = 3600.0, max_stored_jobs: int = 256, owner_lost_s: float = 10.0,
                 clock: Callable[[], float] = time.time):
        if owner_lost_s <= POLL_S:
            raise ValueError(f"expected owner_lost_s > the poll period ({POLL_S} s), got {owner_lost_s}")
        self.job_ttl_s, self.max_stored_jobs, self.owner_lost_s, self.clock = (job_ttl_s, max_stored_jobs,
                                                                             owner_lost_s, clock)
        self._jobs: dict[str, dict] = {}  # id -> {"owner", "kind", "items", "record", "content"}
        self._owners: dict[str, dict] = {}  # owner -> {"seen", "state", "commands", "wake"}
        self._changed = asyncio.Condition()
        self._reports: dict[str, dict[str, str]] = {}  # metrics request -> owner -> its Prometheus text
        self._tokens = itertools.count()

    # ----- owners -----
    def _owner(self, owner: str) -> dict:
        entry = self._owners.get(owner)
        if entry is None:
            entry = self._owners[owner] = {"seen": self.clock(), "state": {}, "commands": [], "wake": asyncio.Event()}
        return entry

    def _send(self, owner: str, command: tuple) -> bool:
        entry = self._owners.get(owner)
        if entry is None:
            return False
        entry["commands"].append(command)
        entry["wake"].set()
        return True

    async def poll(self, owner: str, state: dict, held: list[str], timeout_s: float = POLL_S) -> dict:
        """An owner's lease and command channel. state: what ``/health`` shows of it (state, reason, ranks...);
        held: the ids of the video jobs it holds. Returns ``{"commands": [(verb, arg), ...], "missing": ids}``
        as soon as a command waits (else after `timeout_s`); missing: the held jobs the directory does not know
        (it was recreated): the owner registers them again."""
        entry = self._owner(owner)
        entry["seen"], entry["state"] = self.clock(), dict(state)
        missing = [job_id for job_id in held if job_id not in self._jobs]
        await self._expire()
        if not entry["commands"] and not missing:
            entry["wake"].clear()
            try:
                await asyncio.wait_for(entry["wake"].wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        entry["seen"] = self.clock()
        commands, entry["commands"] = entry["commands"], []
        return {"commands": commands, "missing": missing}

    async def report(self, owner: str, state: dict) -> None:
        """An owner's state changed (its engine failed): shown at once, not at its next poll."""
        entry = self._owner(owner)
        entry["seen"], entry["state"] = self.clock(), dict(state)

    async def leave(self, owner: str) -> None:
        """An owner stops (drained): its jobs that had not ended fail (none should be left)."""
        self._owners.pop(owner, None)
        await self._fail_jobs_of(owner)

    async def replicas(self) -> dict[str, dict]:
        """Each live owner's last state (what it sent with its poll) and ``age_s``, the seconds since it polled."""
        await self._expire()
        now = self.clock()
        return {owner: {**entry["state"], "age_s": round(now - entry["seen"], 3)}
                for owner, entry in self._owners.items()}

    async def _expire(self) -> None:
        now = self.clock()
        for owner in [o for o, e in self._owners.items() if now - e["seen"] > self.owner_lost_s]:
            del self._owners[owner]
            await self._fail_jobs_of(owner)
        ended = sorted((j for j in self._jobs.values() if j["record"]["status"] in TERMINAL),
                       key=lambda j: j["record"].get("finished") or 0)
        excess = len(self._jobs) - self.max_stored_jobs
        for job in ended:
            if excess > 0 or now - (job["record"].get("finished") or now) > self.job_ttl_s:
                del self._jobs[job["record"]["id"]]
                excess -= 1

    async def _fail_jobs_of(self, owner: str) -> None:
        now = self.clock()
        lost = [j for j in self._jobs.values() if j["owner"] == owner and j["record"]["status"] not in TERMINAL]
        for job in lost:
            job["record"] = _lost(job["record"], owner, now)
        if lost:
            await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # ----- jobs, owner side -----
    async def register(self, owner: str, kind: str, items: list, record: dict, content: bytes | None = None) -> None:
        """A new job of `owner` (items: its `GenerationRequest` list, sent once), or one registered again."""
        self._owner(owner)
        self._jobs[record["id"]] = {"owner": owner, "kind": kind, "items": items, "record": dict(record),
                                    "content": content}
        await self._notify()

    async def update(self, owner: str, record: dict, content: bytes | None = None) -> bool:
        """The job's new state (and its MP4 once completed); False when the directory does not know the job (it
        was recreated, or the job was forgotten): the owner registers it again, or drops it."""
        job = self._jobs.get(record["id"])
        if job is None:
            return False
        if record.get("seq", 0) > job["record"].get("seq", 0):
            job["owner"], job["record"] = owner, dict(record)
            if content is not None:
                job["content"] = content
            await self._notify()
        return True

    # ----- jobs, reader side -----
    async def get(self, job_id: str) -> dict | None:
        """``{"owner", "kind", "items", "record", "has_content"}`` of a job, None when unknown (never existed,
        deleted, expired)."""
        await self._expire()
        job = self._jobs.get(job_id)
        return None if job is None else self._view(job)

    @staticmethod
    def _view(job: dict) -> dict:
        return {"owner": job["owner"], "kind": job["kind"], "items": job["items"], "record": job["record"],
                "has_content": job["content"] is not None}

    async def watch(self, job_id: str, seq: int, timeout_s: float = POLL_S) -> dict | None:
        """`get` as soon as the job's record is newer than `seq` (or after `timeout_s`); None once it is gone."""
        deadline = self.clock() + timeout_s

        def newer() -> bool:
            job = self._jobs.get(job_id)
            return job is None or job["record"].get("seq", 0) > seq

        async with self._changed:
            while not newer():
                remaining = deadline - self.clock()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except asyncio.TimeoutError:
                    break
        return await self.get(job_id)

    async def content(self, job_id: str) -> bytes | None:
        job = self._jobs.get(job_id)
        return None if job is None else job["content"]

    async def listing(self, kind: str, held: list[str] = ()) -> list[dict]:
        """`get` of every job of `kind`, without the items of those in `held` (the caller has them already: an
        image-to-video job's items carry its input image)."""
        await self._expire()
        held = set(held)
        return [{**self._view(j), "items": None} if j["record"]["id"] in held else self._view(j)
                for j in self._jobs.values() if j["kind"] == kind]

    async def cancel(self, job_id: str) -> bool:
        """Ask the job's owner to cancel it (its state comes back through `update`); False when unknown or ended,
        or when its owner is gone."""
        job = self._jobs.get(job_id)
        if job is None or job["record"]["status"] in TERMINAL:
            return False
        return self._send(job["owner"], ("cancel", job_id))

    async def forget(self, job_id: str) -> bool:
        """Delete an ended job everywhere: gone from the directory at once (every replica answers 404), and its
        owner drops its copy. False when unknown."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            return False
        self._send(job["owner"], ("forget", job_id))
        await self._notify()
        return True

    # ----- metrics -----
    async def gather_metrics(self, asker: str, timeout_s: float = 2.0) -> dict[str, str]:
        """The Prometheus text of every live owner but `asker` (which renders its own), each asked through its poll
        and waited for up to `timeout_s`: ``{owner: text}`` of those that answered in time."""
        await self._expire()
        token = str(next(self._tokens))
        asked = [o for o in self._owners if o != asker and self._send(o, ("metrics", token))]
        reports = self._reports[token] = {}
        deadline = self.clock() + timeout_s
        try:
            async with self._changed:
                while len(reports) < len(asked) and self.clock() < deadline:
                    try:
                        await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - self.clock()))
                    except asyncio.TimeoutError:
                        break
        finally:
            del self._reports[token]
        return reports

    async def report_metrics(self, owner: str, token: str, text: str) -> None:
        if token in self._reports:
            self._reports[token][owner] = text
            await self._notify()

    async def ping(self) -> dict[str, Any]:
        return {"jobs": len(self._jobs), "owners": len(self._owners)}
