"""Two replicas' queues and mirrors sharing one job directory, in one process and without Ray: a video job submitted
on replica A is registered before its answer leaves, held and followed by replica B (state, steps, MP4), cancelled
and deleted through B, and registered again when the directory is recreated. A's queue is driven as its worker
would drive it (`next_batch`, `step`, `complete`)."""

from __future__ import annotations

import asyncio
import contextlib

from xstage_dit.deploy.directory import JobDirectory
from xstage_dit.deploy.jobs import HeldJob, MirroredQueue, close_scope, open_scope
from xstage_dit.deploy.mirror import DirectoryClient, Mirror
from xstage_dit.runtime.generation import GenerationRequest
from xstage_dit.server.job_queue import Job


class Replica:
    def __init__(self, name: str, holder: dict):
        self.name = name
        self.queue = MirroredQueue(max_queue=8, max_batch_size=1)
        client = DirectoryClient(lambda: holder["directory"], local=True)
        self.mirror = Mirror(name, self.queue, client, lambda: {"state": "ready"}, self.metrics)
        self.task: asyncio.Task | None = None

    async def metrics(self) -> str:
        return f"xstage_queue_depth {self.queue.depth}\n"

    def start(self) -> None:
        self.task = self.mirror.start()

    async def submit(self, steps: int = 4) -> Job:
        """A video job submitted as the server's handler does, inside a request scope; waits for what the answer
        waits for (its registration)."""
        item = GenerationRequest(kind="video", prompt="a cat", width=32, height=32, steps=steps, guidance=5.0,
                                 num_frames=5)
        scope, token = open_scope()
        try:
            job = self.queue.submit(Job(id=f"video_{self.name}{len(self.queue.jobs())}", items=[item],
                                        deadline=1e12))
        finally:
            close_scope(token)
        assert len(scope.pending) == 1 and scope.jobs == [job] and scope.never_started()
        await scope.settle(5.0)
        return job


def kill(directory: JobDirectory) -> None:
    """Every later call of `directory` fails, as calls of a dead actor do."""
    async def dead(*args, **kwargs):
        raise RuntimeError("the actor died")

    for name in ("poll", "report", "leave", "replicas", "register", "update", "get", "watch", "content", "listing",
                 "cancel", "forget", "gather_metrics", "report_metrics"):
        setattr(directory, name, dead)


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def two_replicas():
    holder = {"directory": JobDirectory()}
    a, b = Replica("a", holder), Replica("b", holder)
    a.start()
    b.start()
    try:
        yield a, b, holder
    finally:
        for r in (a, b):
            await r.mirror.stop()
            r.task.cancel()


def test_a_job_of_one_replica_is_followed_and_downloaded_through_the_other():
    async def scenario():
        async with two_replicas() as (a, b, holder):
            job = await a.submit()
            await b.mirror.resolve(job.id)
            held = b.queue.get(job.id)
            assert isinstance(held, HeldJob) and held.status == "queued" and held.items == job.items
            events = held.subscribe()
            batch = await asyncio.to_thread(a.queue.next_batch, 1.0)  # the worker takes it
            assert batch.jobs == [job]
            for step in range(1, 5):
                assert a.queue.step(batch, step, 4, 0.01)
            a.queue.complete(batch, [b"\x00\x00\x00\x18ftypmp4"], run_s=0.1)
            await until(lambda: held.done)
            seen = []
            while not events.empty():
                seen.append(events.get_nowait())
            assert seen[-1]["status"] == "completed" and [e["steps_done"] for e in seen] == sorted(
                e["steps_done"] for e in seen)
            assert held.steps_done == 4 and held.step_times == job.step_times and held.results == []
            await b.mirror.resolve(job.id, content=True)  # a download fetches the MP4
            assert held.results == [b"\x00\x00\x00\x18ftypmp4"]
            await b.mirror.sync("video")
            assert [j.id for j in b.queue.jobs()] == [job.id]

    asyncio.run(scenario())


def test_cancel_and_delete_through_the_other_replica_reach_the_owner():
    async def scenario():
        async with two_replicas() as (a, b, holder):
            job = await a.submit(steps=50)
            batch = await asyncio.to_thread(a.queue.next_batch, 1.0)
            a.queue.step(batch, 1, 50, 0.01)
            await b.mirror.resolve(job.id)
            held = b.queue.get(job.id)
            await until(lambda: held.status == "in_progress")
            b.queue.cancel(job.id)  # what DELETE /v1/jobs/{id} does on B
            await until(lambda: job.cancel_requested)  # A's poll delivered it
            assert not a.queue.step(batch, 2, 50, 0.01)  # the worker's next step ends it
            await until(lambda: held.done)
            assert held.status == "cancelled" and held.error_code == 499
            a.queue.release(batch)
            scope, token = open_scope()
            try:
                assert b.queue.delete(job.id) is held  # DELETE /v1/videos/{id} on B, once it ended
            finally:
                close_scope(token)
            await scope.settle(5.0)
            assert await holder["directory"].get(job.id) is None  # gone for every replica at once
            await until(lambda: a.queue.get(job.id) is None)  # and from its owner
            await b.mirror.resolve(job.id)
            assert b.queue.get(job.id) is None

    asyncio.run(scenario())


def test_a_recreated_directory_gets_the_owners_jobs_again():
    async def scenario():
        async with two_replicas() as (a, b, holder):
            job = await a.submit()
            batch = await asyncio.to_thread(a.queue.next_batch, 1.0)
            a.queue.complete(batch, [b"mp4"], run_s=0.1)
            a.queue.release(batch)
            assert await a.mirror.flush(5.0)
            kill(holder["directory"])  # the directory actor died and Serve started a new one
            holder["directory"] = JobDirectory()
            for _ in range(400):  # A's next poll fails, resolves the new one, which names the job it lacks
                if await holder["directory"].get(job.id) is not None:
                    break
                await asyncio.sleep(0.02)
            await b.mirror.resolve(job.id, content=True)
            held = b.queue.get(job.id)
            assert held.status == "completed" and held.results == [b"mp4"]

    asyncio.run(scenario())


def test_an_own_job_is_never_replaced_by_a_copy():
    async def scenario():
        async with two_replicas() as (a, b, holder):
            job = await a.submit()
            await a.mirror.resolve(job.id)
            await a.mirror.sync("video")
            assert a.queue.get(job.id) is job and a.queue.own_jobs() == [job] and not a.queue.idle()

    asyncio.run(scenario())
