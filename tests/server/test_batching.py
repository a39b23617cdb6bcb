"""The batcher's rule (fake timings): batch a size only where a batch raises images/s by the margin and
its images are bit-identical to single runs; FIFO (no batch wait, one call per image) everywhere else;
decisions and measured speedups in /metrics."""

from __future__ import annotations

import time

import pytest

from xstage_dit.runtime.generation import GenerationRequest
from xstage_dit.server.batching import Batcher, Probe, decide
from xstage_dit.server.job_queue import Job, JobQueue
from xstage_dit.server.metrics import Metrics

SIZE = (1024, 1024, 1)


@pytest.mark.parametrize("single, batch, identical, margin, want", [
    (0.176, 0.70, True, 0.10, False),   # FLUX 1024^2 on an H200: 4 images in 4x the time, no gain
    (0.050, 0.15, True, 0.10, True),    # 512^2: a batch of 4 at 1.33x images/s
    (0.050, 0.15, False, 0.10, False),  # ... but its images differ from single runs: kept apart
    (0.100, 0.3636, True, 0.10, True),  # 1.1001x: just over the margin
    (0.100, 0.3640, True, 0.10, False),  # 1.0989x: just under it
    (0.100, 0.3640, True, 0.05, True),  # a smaller margin accepts it
])
def test_decision_rule(single, batch, identical, margin, want):
    probe = Probe(SIZE, 4, single, batch, identical)
    assert probe.speedup == pytest.approx(4 * single / batch)
    decision = decide(probe, margin)
    assert decision.batch is want, decision.reason
    if not identical:
        assert "differ" in decision.reason


def test_probe_and_batcher_reject_bad_values():
    with pytest.raises(ValueError, match="expected a probe batch of n >= 2 items, got 1"):
        Probe(SIZE, 1, 0.1, 0.1, True)
    with pytest.raises(ValueError, match="expected batch_step_s > 0 seconds, got 0.0"):
        Probe(SIZE, 2, 0.1, 0.0, True)
    with pytest.raises(ValueError, match="expected a batching policy in auto, always, never, got 'sometimes'"):
        Batcher("sometimes")
    with pytest.raises(ValueError, match="expected a batching margin >= 0, got -0.1"):
        Batcher("auto", margin=-0.1)


def _request(width, n=1, seed=0):
    return GenerationRequest(kind="image", prompt="p", width=width, height=width, steps=2, guidance=0.0,
                             seed=seed, n=n)


def _job(width, n=1, seed=0):
    return Job(id=f"j{width}-{seed}", items=_request(width, n, seed).per_image(), deadline=time.time() + 60)


def test_policies_and_unmeasured_sizes():
    metrics = Metrics()
    auto = Batcher("auto", max_batch_size=4, metrics=metrics)
    key_big, key_small = _request(1024).batch_key, _request(512).batch_key
    assert auto.limit(key_big) == 1 and "not measured" in auto.decision(key_big).reason
    auto.record(Probe((1024, 1024, 1), 4, 0.176, 0.70, True))
    auto.record(Probe((512, 512, 1), 4, 0.05, 0.15, True))
    assert auto.limit(key_big) == 1 and auto.limit(key_small) == 4
    assert Batcher("always", 4).limit(key_big) == 4 and Batcher("never", 4).limit(key_small) == 1
    text = metrics.render().decode()
    assert 'xstage_batch_speedup{size="512x512"} 1.333' in text
    assert 'xstage_batch_identical{size="1024x1024"} 1.0' in text
    assert auto.report()["sizes"]["1024x1024"]["batch"] is False


def test_queue_batches_where_it_pays_and_runs_fifo_elsewhere():
    metrics = Metrics()
    batcher = Batcher("auto", max_batch_size=4, metrics=metrics)
    batcher.record(Probe((1024, 1024, 1), 4, 0.176, 0.70, True))
    batcher.record(Probe((512, 512, 1), 4, 0.05, 0.15, True))
    # A long batch wait: FIFO must not pay it (no request waits for others), batching may.
    q = JobQueue(max_queue=16, max_batch_size=4, batch_wait_s=5.0, metrics=metrics, batcher=batcher)
    for seed in range(3):
        q.submit(_job(1024, seed=seed))
    started = time.monotonic()
    first = q.next_batch(timeout_s=1)
    assert time.monotonic() - started < 1.0, "a FIFO batch waited for compatible requests"
    assert first.size == 1 and first.jobs[0].id == "j1024-0" and not first.one_at_a_time
    for seed in range(4):
        q.submit(_job(512, seed=seed))
    q.release(first)
    second = q.next_batch(timeout_s=1)
    assert second.size == 1 and second.jobs[0].id == "j1024-1"
    q.release(second)
    third = q.next_batch(timeout_s=1)
    q.release(third)
    batched = q.next_batch(timeout_s=1)
    assert batched.size == 4 and {j.id for j in batched.jobs} == {f"j512-{s}" for s in range(4)}
    text = metrics.render().decode()
    assert 'xstage_batch_decisions_total{outcome="fifo"} 2.0' in text
    assert 'xstage_batch_decisions_total{outcome="single"} 1.0' in text
    assert 'xstage_batch_decisions_total{outcome="batched"} 1.0' in text


def test_a_request_for_several_images_runs_one_call_per_image_under_fifo():
    batcher = Batcher("auto", max_batch_size=4)
    batcher.record(Probe((64, 64, 1), 4, 0.1, 0.4, False))
    q = JobQueue(max_queue=4, max_batch_size=4, batcher=batcher)
    q.submit(_job(64, n=3))
    batch = q.next_batch(timeout_s=1)
    assert batch.size == 3 and batch.one_at_a_time
    always = JobQueue(max_queue=4, max_batch_size=4, batcher=Batcher("always", 4))
    always.submit(_job(64, n=3))
    assert not always.next_batch(timeout_s=1).one_at_a_time
