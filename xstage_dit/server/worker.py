"""The multi-rank worker: rank 0 takes batches from the queue and broadcasts them; every rank runs the
(parallelized) pipeline on them; rank 0 answers.

Control messages travel over a gloo group (a CPU channel, even when the pipeline's own collectives use
NCCL), always as `broadcast_object_list` from rank 0, tagged so that a rank can never mistake one for
another:

- ``("run", batch_id, items, one_at_a_time)``: run this batch (a list of `GenerationRequest`), as one
  call or one call per image;
- ``("ping",)``: sent when idle, so a waiting rank never hits the collective timeout;
- ``("stop",)``: shut down.

No message travels per step: cancellation is a `StopVote` (a non-blocking all-reduce every
``stop_check_steps`` steps, read one vote late), so no step waits on the control channel and all ranks
stop at the same step. Rank 0 encodes PNG/MP4 on a thread pool, so the next batch starts at once.

Liveness: every rank > 0 bumps a counter in a TCPStore hosted by rank 0 twice a second; rank 0's
monitor thread declares a rank dead when its counter stops moving for `heartbeat_timeout_s`, or when
a control broadcast fails. Then `/health` answers 503, every waiting and running job ends with 503,
new jobs are refused with 503, and after `exit_after_failure_s` the server exits non-zero. Nothing waits
on the dead rank, so nothing hangs. Ranks > 0 exit when rank 0 (the store) disappears.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import socket
import threading
import time
import traceback
from typing import Callable

from xstage_dit.runtime.conditioning import warmup_inputs
from xstage_dit.runtime.generation import GenerationRequest
from xstage_dit.runtime.malloc_heap import keep_freed_memory
from xstage_dit.server.batching import Batcher, Probe
from xstage_dit.server.config import ServedModel, ServerConfig
from xstage_dit.server.control import StopVote, reducer
from xstage_dit.server.failures import failure_answer
from xstage_dit.runtime.gc_pauses import GcPauses, freeze_heap, unfreeze_heap
from xstage_dit.server.job_queue import Batch, JobQueue
from xstage_dit.server.media import encode_batch
from xstage_dit.server.metrics import Metrics
from xstage_dit.server.previews import PreviewPlan
from xstage_dit.server.ranks import ControlChannel, ControlError, LoadedModel, RankContext, RankDesync, _store
from xstage_dit.server.runner import BatchRunner, BatchStopped, RunResult
from xstage_dit.server.step_cache import adopt_step_cache

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
IDLE_PING_S = 1.0
LOADING, READY, FAILED, STOPPED = "loading", "ready", "failed", "stopped"


class Worker:
    """Runs on every rank. Rank 0: `start()` a thread that loads, then serves the queue. Others:
    `run_follower()` in the main thread until rank 0 says stop or disappears.

    load: called on every rank once the ranks have joined; returns a `LoadedModel`.
    join: returns this process's `RankContext` (default: world 1, nothing to join).
    on_fatal: called on rank 0 `exit_after_failure_s` after a failure (the server then exits).
    """

    def __init__(self, load: Callable[[RankContext], LoadedModel], config: ServerConfig, queue: JobQueue | None = None,
                 metrics: Metrics | None = None, join: Callable[[], RankContext] = RankContext,
                 on_fatal: Callable[[str], None] | None = None):
        self.load = load
        self.config = config
        self.metrics = metrics or Metrics()
        self.batcher = Batcher(config.batching, config.max_batch_size, config.batch_margin, self.metrics)
        self.queue = queue or JobQueue(config.max_queue, config.max_batch_size, config.batch_wait_s,
                                       config.job_ttl_s, config.max_stored_jobs, self.metrics, self.batcher)
        # PNG/MP4 encoding off the worker thread: the next batch's GPU work starts while this one encodes.
        self._encoder = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="xstage-encode")
        self.join = join
        self.on_fatal = on_fatal
        self.state = LOADING
        self.reason: str | None = None
        self.ctx: RankContext | None = None
        self.model: LoadedModel | None = None
        self.ranks: dict[int, dict] = {}
        self._batch_id = 0
        self._current_batch: int | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._gc, self._frozen = GcPauses(), False
        self.metrics.watch_gc(self._gc)
        self._ready_event = threading.Event()
        self._lock = threading.Lock()
        self._own_engine = None  # the engine of what this worker applied itself (`_runner`), undone at stop

    # ----- common -----
    @property
    def served(self) -> ServedModel | None:
        return self.model.served if self.model else None

    def wait_ready(self, timeout_s: float) -> bool:
        self._ready_event.wait(timeout_s)
        return self.state == READY

    def _run_batch(self, runner: BatchRunner, items: list, one_at_a_time: bool,
                   decide: Callable[[int, int, int, list], bool] | None, previews: PreviewPlan | None = None):
        """Every rank: run the pipeline. decide (rank 0 only) says after each step whether any job still
        wants the batch; with several ranks the `StopVote` turns that into one step at which all stop.
        previews (rank 0 only): the partial images its jobs stream (`server.previews`)."""
        vote = None
        if self.ctx.world_size > 1:
            vote = StopVote(reducer(self.ctx.control_group), self.config.stop_check_steps)

        def on_step(done: int, total: int, gpu_done: int, step_times: list) -> bool:
            keep = decide(done, total, gpu_done, step_times) if decide is not None else True
            if vote is None:
                return keep
            try:
                return not vote.step(done, want_stop=not keep)
            except Exception as exc:  # noqa: BLE001
                raise ControlError(f"lost a rank: stop vote failed ({str(exc).splitlines()[0][:200]})") from exc

        # The rank that answers encodes a video while its VAE decodes it (`video_stream`); the others need no MP4.
        stream = decide is not None and self.config.streams_video(runner.device)
        result = runner.run(items, on_step, one_at_a_time, stream_video=stream, previews=previews)
        if vote is not None:
            try:
                vote.finish()
            except BaseException:
                result.discard()
                raise
        return result

    def warmup_items(self) -> list[tuple[int, int]]:
        """(width, height) of every warm-up: the model's default size, then `ServerConfig.warmup_sizes`."""
        s = self.model.served
        sizes = [(s.default_width, s.default_height)]
        sizes += [size for size in self.config.warmup_sizes if size not in sizes]
        return sizes

    def _runner(self) -> BatchRunner:
        """The runner (the model's step cache adopted first); an image pipeline computes a batch as its images alone
        (`features.batch_invariance`, as `generate` does: the same bytes), so batching can keep the promise of
        docs/serving.md. The loader's engine applied it (`startup.model_loader`); a pipeline handed in as it is
        (in-process servers) gets it here, through an engine of that one feature, undone when the worker stops."""
        adopt_step_cache(self.model, self.batcher)
        if self.model.engine is None and self._own_engine is None:
            from xstage_dit.engine import Engine, EngineConfig
            from xstage_dit.features.compile import CompileConfig

            only = EngineConfig(parallel=None, compile=CompileConfig("off"), batch_invariance="auto",
                                host_syncs=False, text_depth=False, prompt_cache=False, one_frame_vae=False)
            self._own_engine = Engine(only)
            invariance = self._own_engine.apply(self.model.pipe, kind=self.model.served.kind).batch_invariance
            if invariance is not None:
                self.model.report["batch_invariance"] = invariance.describe()
        return BatchRunner(self.model.pipe, self.model.served, self.model.adapters, self.ctx.control_group,
                           self.model.recovery)

    def _restore_own(self) -> None:
        """Undo the stacks on the worker's model when it stops: what it applied itself (batch invariance on a
        handed-in pipeline), then the loader's engine; a pipeline handed in as it is stays as it came."""
        engine, self._own_engine = self._own_engine, None
        if engine is not None:
            engine.restore()
        loaded = self.model.engine if self.model is not None else None
        if loaded is not None:
            loaded.restore()

    def _warmup(self, runner: BatchRunner) -> None:
        """Every rank: warm up (`_warm_sizes`), then freeze the heap alive now out of the garbage collector's
        way (`gc_pauses`; a full collection would stop a request for a few hundred ms) and count its pauses.
        Before the warm-up, malloc is told to keep freed memory (`malloc_heap`): the warm-up's answers then leave
        the heap that later answers reuse without page faults."""
        self._gc.install()
        if self.config.keep_freed_memory:
            self.model.report["malloc"] = keep_freed_memory()
        if self.config.warmup:
            self._warm_sizes(runner)
        if self.config.gc_freeze:
            heap = freeze_heap()
            self._frozen = True
            self.model.report["gc_freeze"] = heap
            log.info("froze %d objects after warm-up (collecting them took %.3f s): collections skip them",
                     heap["frozen_objects"], heap["collect_s"])

    def _thaw(self) -> None:
        """On stop: the frozen objects back to the collector, the pause counting off."""
        if self._frozen:
            unfreeze_heap()
            self._frozen = False
        self._gc.uninstall()

    def _warm_sizes(self, runner: BatchRunner) -> None:
        """Two steps at the default size and at each warm-up size, so the first request pays no
        first-call cost (torch.compile of that shape, kernel builds, allocator growth) and the schedules are
        chosen (and logged) at start-up. Where the batcher measures (policy auto), a batch of
        max_batch_size follows each size: its per-step time against one image's, and its images against
        the single ones, decide whether that size batches. Same work on every rank, no control messages:
        the collectives inside match."""
        s = self.model.served
        never = lambda *_: True  # noqa: E731
        for width, height in self.warmup_items():
            # an edit or image-to-video model warms up on synthetic input images: the shapes it serves
            inputs = warmup_inputs(s.image_inputs, width, height) if s.warm_with_images else None
            item = GenerationRequest(kind=s.kind, prompt="warm-up", width=width, height=height, steps=2,
                                     guidance=s.default_guidance, seed=0, num_frames=s.default_frames, inputs=inputs)
            started = time.perf_counter()
            single = runner.warmup(item, never)
            log.info("warm-up %dx%d (2 steps) took %.2f s", width, height, time.perf_counter() - started)
            if not self.batcher.wants_probe or s.kind != "image" or (inputs is not None and inputs.alone):
                continue  # a batch of videos never pays and may not fit: videos run FIFO (an "alone" edit, too)
            self.batcher.probe(runner, item, single, self.config.max_batch_size)

    # ----- rank 0 -----
    def start(self) -> "Worker":
        self._thread = threading.Thread(target=self._leader_main, name="xstage-worker", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving (rank 0): tells the other ranks to exit, then joins the worker thread."""
        self._stop.set()
        if self._thread is not None and self.state != FAILED:  # a failed worker may sit in a dead collective
            self._thread.join(timeout=10)
        self._thaw()
        if self._thread is None or not self._thread.is_alive():  # never under a batch still running
            self._restore_own()

    def fail(self, reason: str) -> None:
        """Rank 0: a rank died or the ranks disagree. Everything pending ends with 503."""
        with self._lock:
            if self.state in (FAILED, STOPPED):
                return
            self.state, self.reason = FAILED, reason
        log.error("serving stopped: %s", reason)
        self.metrics.ranks_ready.set(0)
        self.metrics.errors.labels("rank_failure").inc()
        self.queue.close(f"server unavailable: {reason}", 503)
        self._ready_event.set()
        if self.on_fatal is not None and self.config.exit_after_failure_s is not None:
            timer = threading.Timer(self.config.exit_after_failure_s, self.on_fatal, args=(reason,))
            timer.daemon = True
            timer.start()

    def _leader_main(self) -> None:
        try:
            self.ctx = self.join()
            store = None
            if self.ctx.world_size > 1:
                store = _store(self.ctx, 0, is_master=True)
                ControlChannel(self.ctx).send(("store", store.port))
                threading.Thread(target=self._monitor, args=(store,), name="xstage-monitor", daemon=True).start()
            self.metrics.world_size.set(self.ctx.world_size)
            started = time.perf_counter()
            self.model = self.load(self.ctx)
            runner = self._runner()
            self._warmup(runner)
            self.ranks[0] = {"rank": 0, "pid": os.getpid(), "host": socket.gethostname(),
                             "load_s": round(time.perf_counter() - started, 3)}
            if store is not None:
                client = _store(self.ctx, store.port, is_master=False)
                for r in range(1, self.ctx.world_size):
                    info = json.loads(client.get(f"ready/{r}").decode())
                    self.ranks[r] = info
                self._client = client
            log.info("start-up report: %s", self.model.current_report())
        except Exception as exc:  # noqa: BLE001 - start-up failure is reported, not raised in a thread
            log.error("start-up failed:\n%s", traceback.format_exc())
            self.fail(f"start-up failed: {exc}")
            return
        with self._lock:
            if self.state == LOADING:
                self.state = READY
        if self.state != READY:
            return
        self.metrics.ranks_ready.set(1)
        self._ready_event.set()
        log.info("ready: model %s on %d rank(s)", self.model.served.name, self.ctx.world_size)
        self._leader_loop(runner)

    def _leader_loop(self, runner: BatchRunner) -> None:
        channel = ControlChannel(self.ctx)
        while not self._stop.is_set() and self.state == READY:
            batch = self.queue.next_batch(timeout_s=IDLE_PING_S)
            if self.state != READY:
                return
            try:
                if batch is None:
                    channel.send(("ping",))
                    continue
                self._batch_id += 1
                channel.send(("run", self._batch_id, batch.items, batch.one_at_a_time))
            except Exception as exc:  # noqa: BLE001 - a broadcast to a dead rank
                self.fail(f"lost a rank: control broadcast failed ({str(exc).splitlines()[0][:200]})")
                return
            self._leader_batch(runner, channel, batch)
        if self._stop.is_set() and self.state == READY:
            try:
                channel.send(("stop",))
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
            self.state = STOPPED
        self._encoder.shutdown(wait=True)

    def _leader_batch(self, runner: BatchRunner, channel: ControlChannel, batch: Batch) -> None:
        m = self.metrics
        m.batch_size.observe(batch.size)
        for job in batch.jobs:
            m.queue_wait.observe(job.timings()["queued_s"])

        def decide(done: int, total: int, gpu_done: int, step_times: list) -> bool:
            # Host work only (a lock, a few appends): the GPU runs the queued steps meanwhile.
            for step_s in step_times:
                m.step_time.observe(step_s)
            return self.queue.step(batch, gpu_done, total, step_times) and self.state == READY

        started, gc_before = time.perf_counter(), self._gc.total_s()
        self._current_batch = self._batch_id
        status, error, result = "ok", None, None
        try:
            result = self._run_batch(runner, batch.items, batch.one_at_a_time, decide, PreviewPlan.for_batch(batch))
        except BatchStopped:
            status = "stopped"
        except ControlError as exc:
            self.fail(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a failed batch fails its jobs, the server goes on
            status, error = "error", f"{type(exc).__name__}: {exc}"
            log.error("batch %d failed:\n%s", self._batch_id, traceback.format_exc())
        run_s = time.perf_counter() - started
        delivered = False
        try:
            delivered = self._after_batch(batch, status, error, result, run_s, self._gc.total_s() - gc_before)
        finally:
            if result is not None and not delivered:
                result.discard()  # an MP4 encoded meanwhile is dropped, its encoder stopped

    def _after_batch(self, batch: Batch, status: str, error: str | None, result, run_s: float, gc_s: float) -> bool:
        """Rank 0 after a batch: the other ranks' status, then delivery (True: `result` handed to the encoder
        thread) or the jobs failed / released (False)."""
        if self.state != READY:
            return False
        if self.ctx.world_size > 1:
            try:
                for r in range(1, self.ctx.world_size):
                    peer = self._client.get(f"status/{self._batch_id}/{r}").decode()
                    self._client.delete_key(f"status/{self._batch_id}/{r}")
                    if peer != "ok" and peer != "stopped" and status != "error":
                        status, error = "error", f"rank {r}: {peer}"
            except Exception as exc:  # noqa: BLE001
                self.fail(f"rank status exchange failed: {exc}")
                return False
        self._current_batch = None
        if status == "ok":
            self._encoder.submit(self._deliver, batch, result, run_s, gc_s)
            return True
        if status == "error":
            self.metrics.errors.labels("pipeline").inc()
            self.queue.fail_batch(batch, *failure_answer(error))
        self.queue.release(batch)
        return False

    def _deliver(self, batch: Batch, result: RunResult, run_s: float, gc_s: float) -> None:
        """Encoder thread: PNG/MP4 bytes to their jobs, while the worker runs the next batch. A video encoded
        during its call (`video_stream`) only waits for the encoder's last frames here."""
        m = self.metrics
        try:
            started = time.perf_counter()
            stream, result.video_stream = result.video_stream, None
            streamed = stream.finish(result.pixels[0]) if stream is not None else None
            encodings = [job.encoding for job in batch.owners]
            outputs = [streamed] if streamed is not None else encode_batch(result.pixels, batch.items, encodings)
            encode_s = time.perf_counter() - started
        except Exception as exc:  # noqa: BLE001
            m.errors.labels("pipeline").inc()
            self.queue.fail_batch(batch, f"generation failed: encoding failed: {exc}", 500)
        else:
            self.queue.complete(batch, outputs, run_s, encode_s, gc_s, result.cache)
            m.batch_latency.observe(run_s)
            for job in batch.jobs:
                if job.status == "completed":
                    m.request_latency.labels(job.kind).observe(job.timings()["total_s"])
                    m.items.labels(job.kind).inc(len(job.items))
                    m.count_step_cache(job.cache_stats)
        self.queue.release(batch)

    def _monitor(self, store) -> None:
        """Rank 0: watch the other ranks' heartbeat counters; declare failure when one stops."""
        last = {r: (-1, time.monotonic()) for r in range(1, self.ctx.world_size)}
        peer_error: tuple[int, int, str, float] | None = None  # (batch, rank, message, first seen)
        while self.state in (LOADING, READY) and not self._stop.is_set():
            now = time.monotonic()
            batch_id = self._current_batch
            if batch_id is not None and (peer_error is None or peer_error[0] != batch_id):
                peer_error = self._peer_error(store, batch_id, now) or peer_error
            if peer_error is not None and peer_error[0] == self._current_batch and \
                    now - peer_error[3] > self.config.heartbeat_timeout_s:
                # A rank left the batch with an error while rank 0 is still in it (e.g. waiting in a
                # data collective that rank will never join): fail rather than wait for the timeout.
                self.fail(f"rank {peer_error[1]} failed in batch {peer_error[0]}: {peer_error[2]}")
                return
            for r, (count, since) in list(last.items()):
                try:
                    value = store.add(f"hb/{r}", 0)
                except Exception as exc:  # noqa: BLE001
                    self.fail(f"heartbeat store failed: {exc}")
                    return
                if value != count:
                    last[r] = (value, now)
                    if r in self.ranks:
                        self.ranks[r]["last_seen"] = time.time()
                elif now - since > self.config.heartbeat_timeout_s:
                    self.fail(f"rank {r} stopped responding (no heartbeat for {now - since:.1f} s)")
                    return
            time.sleep(HEARTBEAT_INTERVAL_S / 2)

    def _peer_error(self, store, batch_id: int, now: float) -> tuple[int, int, str, float] | None:
        for r in range(1, self.ctx.world_size):
            key = f"status/{batch_id}/{r}"
            try:
                if store.check([key]):
                    status = store.get(key).decode()
                    if status not in ("ok", "stopped"):
                        return batch_id, r, status, now
            except Exception:  # noqa: BLE001 - the heartbeat check reports a broken store
                return None
        return None

    # ----- ranks > 0 -----
    def run_follower(self) -> int:
        """Ranks > 0: load, report ready, then run every batch rank 0 broadcasts. Returns an exit code."""
        self.ctx = self.join()
        channel = ControlChannel(self.ctx)
        message = channel.recv()
        if message[0] != "store":
            raise RankDesync(f"expected ('store', port) from rank 0, got {message!r}")
        port = message[1]
        threading.Thread(target=self._heartbeat, args=(port,), name="xstage-heartbeat", daemon=True).start()
        store = _store(self.ctx, port, is_master=False)
        started = time.perf_counter()
        self.model = self.load(self.ctx)
        runner = self._runner()
        self._warmup(runner)
        store.set(f"ready/{self.ctx.rank}", json.dumps({
            "rank": self.ctx.rank, "pid": os.getpid(), "host": socket.gethostname(),
            "load_s": round(time.perf_counter() - started, 3)}))
        while True:
            message = channel.recv()
            tag = message[0]
            if tag == "ping":
                continue
            if tag == "stop":
                self._stop.set()  # rank 0 may be gone while this rank restores: its heartbeat must not call that a loss
                self._thaw()
                self._restore_own()
                return 0
            if tag != "run":
                raise RankDesync(f"expected a 'run', 'ping' or 'stop' message from rank 0, got {tag!r}")
            batch_id, items, one_at_a_time = message[1], message[2], message[3]
            try:
                self._run_batch(runner, items, one_at_a_time, None)
                status = "ok"
            except BatchStopped:
                status = "stopped"
            except RankDesync:
                raise
            except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the batch
                log.error("rank %d batch %d failed:\n%s", self.ctx.rank, batch_id, traceback.format_exc())
                status = f"{type(exc).__name__}: {exc}"
            store.set(f"status/{batch_id}/{self.ctx.rank}", status)

    def _heartbeat(self, port: int) -> None:
        try:
            store = _store(self.ctx, port, is_master=False)
            while True:
                store.add(f"hb/{self.ctx.rank}", 1)
                time.sleep(HEARTBEAT_INTERVAL_S)
        except Exception as exc:  # noqa: BLE001 - rank 0 is gone: nothing left to serve
            if self._stop.is_set():  # told to stop: rank 0 exits as this rank restores its stack (a clean end)
                return
            log.error("rank %d: lost rank 0 (%s); exiting", self.ctx.rank, exc)
            os._exit(1)
