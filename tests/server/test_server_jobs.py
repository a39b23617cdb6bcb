"""The job queue on its own: batching rules, bounds, cancellation, timeouts, failure (no pipeline)."""

from __future__ import annotations

import threading
import time

import pytest

from xstage_dit.runtime.generation import GenerationRequest
from xstage_dit.server.job_queue import CANCELLED, COMPLETED, FAILED, QUEUED, RUNNING, Job, JobQueue, QueueFull, Unavailable


def params(seed=0, width=32, steps=2, kind="image", negative=None, prompt="a cat"):
    return GenerationRequest(kind=kind, prompt=prompt, width=width, height=32, steps=steps, guidance=3.5, seed=seed,
                             negative_prompt=negative)


def job(*items, timeout_s=60.0):
    return Job(id=f"j{time.perf_counter_ns()}", items=list(items), deadline=time.time() + timeout_s)


def test_compatible_jobs_batch_together_up_to_the_limit_in_fifo_order():
    q = JobQueue(max_queue=10, max_batch_size=3)
    a, b, c, d = job(params(0)), job(params(1, width=48)), job(params(2), params(3)), job(params(4))
    for j in (a, b, c, d):
        q.submit(j)
    first = q.next_batch(0.1)
    # a (1 item) + c (2 items) fill 3; b has another size; d does not fit.
    assert [j.id for j in first.jobs] == [a.id, c.id]
    assert [i.seed for i in first.items] == [0, 2, 3] and first.owners == [a, c, c]
    assert a.status == RUNNING and a.batch_size == 3 and q.depth == 2
    second = q.next_batch(0.1)
    assert [j.id for j in second.jobs] == [b.id]  # oldest waiting job leads, even when incompatible
    third = q.next_batch(0.1)
    assert [j.id for j in third.jobs] == [d.id]
    assert q.next_batch(0.05) is None


def test_negative_prompt_presence_and_steps_split_batches():
    q = JobQueue(max_queue=10, max_batch_size=8)
    for j in (job(params(0)), job(params(1, negative="blurry")), job(params(2, steps=3)), job(params(3))):
        q.submit(j)
    sizes = [q.next_batch(0.1).size for _ in range(3)]
    assert sizes == [2, 1, 1]


def test_queue_full_raises_with_retry_after_and_cancel_frees_the_slot():
    q = JobQueue(max_queue=2, max_batch_size=1)
    a, b = q.submit(job(params(0))), q.submit(job(params(1)))
    with pytest.raises(QueueFull) as exc:
        q.submit(job(params(2)))
    assert exc.value.retry_after_s >= 1
    assert q.cancel(a.id).status == CANCELLED and a.error_code == 499
    q.submit(job(params(3)))  # the cancelled job's slot is free again
    assert q.depth == 2 and b.status == QUEUED


def test_running_job_cancel_stops_at_next_step_and_completes_others():
    q = JobQueue(max_queue=4, max_batch_size=4)
    a, b = q.submit(job(params(0))), q.submit(job(params(1)))
    batch = q.next_batch(0.1)
    assert q.step(batch, 1, 4, 0.01) is True
    q.cancel(a.id)
    assert a.status == RUNNING  # takes effect at the step boundary
    assert q.step(batch, 2, 4, 0.01) is True  # b still wants its image
    assert a.status == CANCELLED and a.steps_done == 2
    q.cancel(b.id)
    assert q.step(batch, 3, 4, 0.01) is False  # nobody left: the worker stops the pipeline
    q.release(batch)
    assert q.running == 0 and b.status == CANCELLED


def test_complete_hands_each_job_its_own_outputs():
    q = JobQueue(max_queue=4, max_batch_size=4)
    a, b = q.submit(job(params(0), params(1))), q.submit(job(params(2)))
    batch = q.next_batch(0.1)
    q.complete(batch, [b"x0", b"x1", b"x2"], run_s=0.5)
    q.release(batch)
    assert a.status == COMPLETED and a.results == [b"x0", b"x1"] and b.results == [b"x2"]
    assert a.steps_done == a.steps_total == 2
    with pytest.raises(ValueError, match="expected 3 outputs"):
        q.complete(batch, [b"x"], run_s=0.1)


def test_a_completion_only_subscriber_is_not_woken_per_step():
    """A request answered in one piece subscribes with progress=False: the worker thread's steps schedule no
    callback on its event loop (each would take the GIL from the host-bound worker), only the final event."""
    import asyncio

    async def scenario():
        loop = asyncio.get_running_loop()
        q = JobQueue(max_queue=4, max_batch_size=4)
        a = job(params(0, steps=4))
        progress_q, final_q = a.subscribe(), a.subscribe(progress=False)
        q.submit(a)
        scheduled = []
        real = loop.call_soon_threadsafe

        def counting(callback, *args):
            scheduled.append(args[0]["status"] if args else None)
            return real(callback, *args)

        loop.call_soon_threadsafe = counting
        batch = q.next_batch(0.1)
        for done in range(1, 5):
            assert q.step(batch, done, 4, 0.01) is True
        q.complete(batch, [b"png"], run_s=0.1)
        q.release(batch)
        await asyncio.sleep(0)
        drained = lambda s: [s.get_nowait() for _ in range(s.qsize())]  # noqa: E731
        return scheduled, drained(progress_q), drained(final_q)

    scheduled, progress, final = asyncio.run(scenario())
    assert [e["status"] for e in final] == [QUEUED, COMPLETED], final  # subscribed while queued, then the end
    assert [e["steps_done"] for e in progress if e["status"] == RUNNING] == [0, 1, 2, 3, 4], progress
    # every event after the first (put at subscription) was scheduled on the loop: the final one for each
    # subscriber, the others for the progress subscriber alone
    assert scheduled.count(COMPLETED) == 2 and len(scheduled) == (len(progress) - 1) + (len(final) - 1), scheduled


def test_timeouts_while_queued_and_while_running():
    q = JobQueue(max_queue=4, max_batch_size=1)
    late = q.submit(job(params(0), timeout_s=-1))
    assert q.next_batch(0.05) is None and late.status == FAILED and late.error_code == 504
    slow = q.submit(job(params(1), timeout_s=0.05))
    batch = q.next_batch(0.1)
    time.sleep(0.06)
    assert q.step(batch, 1, 2, 0.01) is False and slow.error_code == 504


def test_close_fails_everything_with_503_and_refuses_new_jobs():
    q = JobQueue(max_queue=4, max_batch_size=1)
    running, waiting = q.submit(job(params(0))), q.submit(job(params(1)))
    q.next_batch(0.1)
    q.close("rank 1 died", 503)
    assert (running.status, running.error_code, waiting.status, waiting.error_code) == (FAILED, 503, FAILED, 503)
    with pytest.raises(Unavailable, match="rank 1 died"):
        q.submit(job(params(2)))
    assert q.next_batch(0.01) is None


def test_batch_wait_collects_requests_arriving_shortly_after():
    q = JobQueue(max_queue=8, max_batch_size=4, batch_wait_s=0.5)
    q.submit(job(params(0)))

    def late():
        time.sleep(0.05)
        for s in (1, 2, 3):
            q.submit(job(params(s)))

    t = threading.Thread(target=late)
    t.start()
    started = time.perf_counter()
    batch = q.next_batch(1.0)
    t.join()
    assert batch.size == 4
    assert time.perf_counter() - started < 0.45  # returned as soon as the batch was full


def test_finished_jobs_are_pruned_beyond_the_store_limit():
    q = JobQueue(max_queue=8, max_batch_size=1, max_stored_jobs=3)
    done = []
    for s in range(4):
        j = q.submit(job(params(s)))
        q.cancel(j.id)
        done.append(j)
    assert q.get(done[0].id) is None and q.get(done[-1].id) is done[-1]


def test_job_needs_items():
    with pytest.raises(ValueError, match="expected at least one item"):
        Job(id="x", items=[], deadline=0)
