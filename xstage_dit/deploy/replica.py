"""One replica of the engine deployment: a Ray Serve replica that is rank 0 of its own parallel engine.

At start (``__init__``) the replica starts ranks 1 .. world-1 as actors in its placement group (`deploy.ranks`),
joins them, loads and warms up the model through the server's `Worker` (the same loader, stack, warm-up, batching
and failure rules as ``xstage-dit serve``), and only then counts as started: Serve sends it no request before its
engine is ready. Its HTTP app is the server's FastAPI app behind `ReplicaIngress` (``__serve_build_asgi_app__``:
the app is built once the worker exists).

Serve's hooks:

- ``check_health`` fails once the engine failed (a rank died, the ranks disagree): Serve then replaces the replica
  (new actors, a new placement group), while the others keep serving;
- ``record_routing_stats`` says whether the engine is ready (`deploy.router` sends new requests to ready ones);
- ``replay`` answers a request another replica retries here (`ReplicaIngress`), message by message;
- ``__del__`` drains: when Serve removes the replica (scale-down, update, failed health check) it first lets the
  requests in flight end, then calls this, which waits for the replica's video jobs (queued ones included) to end
  and reach the directory, within ``graceful_shutdown_timeout_s``, then stops the ranks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from ray import serve

from xstage_dit.deploy.directory import JobDirectory
from xstage_dit.deploy.ingress import ReplicaIngress
from xstage_dit.deploy.jobs import MirroredQueue
from xstage_dit.deploy.mirror import DirectoryClient, Mirror
from xstage_dit.deploy.options import DeployOptions
from xstage_dit.deploy.ranks import EngineGroup, set_threads
from xstage_dit.deploy.router import EXCLUDE

log = logging.getLogger(__name__)

DIRECTORY = "jobs"  # the deployment-scoped actor holding the job directory
__all__ = ["DIRECTORY", "EngineReplica", "JobDirectory"]


@serve.ingress()
class EngineReplica:
    """The replica (module docstring); `options` is the deployment's `DeployOptions`."""

    async def __init__(self, options: DeployOptions):
        from xstage_dit.server.app import create_app
        from xstage_dit.server.ranks import RankContext
        from xstage_dit.server.startup import model_loader
        from xstage_dit.server.worker import Worker

        self.options = options
        context = serve.get_replica_context()
        self.replica_id, self._deployment = context.replica_id.unique_id, (context.deployment, context.app_name)
        config = options.server
        self.group = EngineGroup(options)
        set_threads(await self.group.start(), options.cpus_per_rank)
        load = model_loader(options.model, config.parallel, **options.loader_kwargs())
        self.worker = Worker(load, config, join=lambda: RankContext.join(config.parallel.timeout_s))
        queue = MirroredQueue(config.max_queue, config.max_batch_size, config.batch_wait_s, config.job_ttl_s,
                              config.max_stored_jobs, self.worker.metrics, self.worker.batcher)
        self.worker.queue = queue  # before start: the worker's own batcher and metrics, the jobs mirrored
        directory = DirectoryClient(lambda: serve.get_deployment_actor(DIRECTORY))
        self.mirror = Mirror(self.replica_id, queue, directory, self._state, self._local_metrics)
        self.ingress = ReplicaIngress(create_app(self.worker), self.replica_id, self.mirror,
                                      self._send_elsewhere if options.retry else None, options.retry_wait_s)
        self._handle: Any = None
        self.worker.start()
        if not await asyncio.to_thread(self.worker.wait_ready, options.start_timeout_s):
            self.group.stop()
            raise RuntimeError(f"replica {self.replica_id}: engine not ready: {self.worker.state}: "
                               f"{self.worker.reason}")
        self.group.watch(self._rank_died)
        self._poll = self.mirror.start()
        log.info("replica %s ready: %s on %d rank(s)", self.replica_id, options.model, options.world_size)

    def __serve_build_asgi_app__(self) -> ReplicaIngress:
        return self.ingress

    # ----- Serve's hooks -----
    def check_health(self) -> None:
        from xstage_dit.server.worker import READY

        if self.worker.state != READY:
            raise RuntimeError(f"engine {self.worker.state}: {self.worker.reason}")

    def record_routing_stats(self) -> dict:
        from xstage_dit.server.worker import READY

        return {"ready": self.worker.state == READY}

    async def replay(self, request: dict, exclude: str | None = None) -> AsyncIterator[dict]:
        """Answer `request` (sent again by replica `exclude`, whose engine failed before it started) through this
        replica's app: the ASGI messages of the answer, one by one."""
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
                 "method": request["method"], "path": request["path"], "raw_path": request["path"].encode(),
                 "query_string": request["query_string"], "root_path": "", "headers": request["headers"],
                 "client": None, "server": None}
        messages: asyncio.Queue = asyncio.Queue()
        gone, sent = asyncio.Event(), []

        async def receive() -> dict:
            if not sent:
                sent.append(True)
                return {"type": "http.request", "body": request["body"], "more_body": False}
            await gone.wait()  # the retrying replica's client left
            return {"type": "http.disconnect"}

        task = asyncio.create_task(self.ingress(scope, receive, messages.put))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                yield message
            await task
        finally:
            gone.set()
            if not task.done():
                task.cancel()

    async def __del__(self) -> None:
        started = time.monotonic()
        deadline = started + self.options.graceful_s - 5.0
        queue = self.worker.queue
        from xstage_dit.server.worker import READY

        while self.worker.state == READY and not queue.idle() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        if not await self.mirror.flush(max(1.0, deadline - time.monotonic())):
            log.warning("replica %s: video job states not all in the directory when it stopped", self.replica_id)
        try:
            await self.mirror.stop()
        except Exception as exc:  # noqa: BLE001 - stopping anyway: the directory drops it after its lease
            log.warning("replica %s: leaving the job directory failed: %s", self.replica_id, exc)
        self.group.stopping = True  # the ranks' runs end now, and that is no failure
        await asyncio.to_thread(self.worker.stop)
        self.group.stop()
        log.info("replica %s stopped after draining for %.1f s", self.replica_id, time.monotonic() - started)

    # ----- helpers -----
    def _state(self) -> dict:
        worker = self.worker
        return {"state": worker.state, "reason": worker.reason, "model": self.options.model,
                "world_size": self.options.world_size, "queue_depth": worker.queue.depth,
                "running": worker.queue.running, "ranks": [worker.ranks[r] for r in sorted(worker.ranks)]}

    async def _local_metrics(self) -> str:
        return await self.ingress.local_metrics()

    def _rank_died(self, reason: str) -> None:
        """From the rank watch thread: fail the engine at once (its jobs end 503) and tell the directory."""
        self.worker.fail(reason)
        if self.mirror.loop is not None:
            asyncio.run_coroutine_threadsafe(self.mirror.report_state(), self.mirror.loop)

    async def _send_elsewhere(self, request: dict) -> AsyncIterator[dict]:
        if self._handle is None:
            self._handle = serve.get_deployment_handle(*self._deployment)
        return self._handle.options(stream=True).replay.remote(request, **{EXCLUDE: self.replica_id})
