"""The garbage collector in the server (`xstage_dit.runtime.gc_pauses`): the heap alive after warm-up is frozen
out of the collector's way, unfrozen on stop; every collection's pause is counted, per batch (`Timings.gc_s`)
and in /metrics."""

from __future__ import annotations

import gc
import json
import weakref

import httpx
import pytest

from tests.helpers.server import live_server, one_torch_thread, start_worker
from xstage_dit.server.app import create_app
from xstage_dit.server.config import ServerConfig
from xstage_dit.runtime.gc_pauses import GcPauses, freeze_heap, unfreeze_heap


class _Cycle:
    """An object that only a collection frees (it refers to itself)."""

    def __init__(self):
        self.me = self


def test_pauses_are_counted_per_generation_until_uninstalled():
    pauses = GcPauses().install()
    try:
        gc.collect(0)
        gc.collect()
        assert pauses.collections[0] >= 1 and pauses.collections[2] >= 1, pauses.collections
        assert pauses.seconds[2] > 0 and pauses.total_s() >= pauses.seconds[2]
    finally:
        pauses.uninstall()
    counted = list(pauses.collections)
    gc.collect()
    assert pauses.collections == counted  # uninstalled: no longer counting
    assert pauses._callback not in gc.callbacks


def test_a_frozen_cycle_survives_collections_until_unfrozen():
    """What freezing means: an unreachable cycle that was alive at the freeze is skipped by every collection
    (the pause it would cost is gone); unfrozen, the next collection frees it."""
    cycle = _Cycle()
    ref = weakref.ref(cycle)
    heap = freeze_heap()
    try:
        assert heap["frozen_objects"] > 1000 and heap["collect_s"] >= 0, heap
        del cycle
        gc.collect()
        assert ref() is not None, "a frozen object was collected"
    finally:
        unfreeze_heap()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None, "an unfrozen unreachable cycle was not collected"


@pytest.fixture(scope="module")
def served():
    with one_torch_thread():
        worker = start_worker(ServerConfig(max_batch_size=1, api_key=None))
        try:
            with live_server(create_app(worker)) as url, httpx.Client(base_url=url, timeout=60) as client:
                yield client, worker
        finally:
            worker.stop()


def test_server_freezes_after_warmup_and_reports_pauses(served):
    client, worker = served
    assert gc.get_freeze_count() > 1000, "expected the heap frozen once the server is ready"
    assert worker.model.report["gc_freeze"]["frozen_objects"] > 1000
    malloc = worker.model.report["malloc"]  # `keep_freed_memory`, applied before the warm-up
    assert malloc["applied"] or "not glibc" in malloc["reason"], malloc
    r = client.post("/v1/images/generations", json={"prompt": "a red cat", "size": "32x32", "seed": 1,
                                                    "num_inference_steps": 2, "response_format": "png"})
    assert r.status_code == 200, r.text[:300]
    timings = json.loads(r.headers["x-timings"])
    assert timings["gc_s"] is not None and 0 <= timings["gc_s"] <= timings["pipeline_s"], timings
    gc.collect()  # at least one collection to show in the totals
    metrics = client.get("/metrics").text
    assert 'xstage_gc_collections_total{generation="2"}' in metrics
    assert 'xstage_gc_pause_seconds_total{generation="2"}' in metrics
    value = next(float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith('xstage_gc_collections_total{generation="2"}'))
    assert value >= 1, metrics


def test_stopping_the_server_unfreezes_the_heap():
    with one_torch_thread():
        worker = start_worker(ServerConfig(max_batch_size=1, api_key=None))
        assert gc.get_freeze_count() > 0
        worker.stop()
    assert gc.get_freeze_count() == 0
    assert worker._gc._callback not in gc.callbacks


def test_gc_freeze_off_leaves_the_heap_to_the_collector():
    with one_torch_thread():
        before = gc.get_freeze_count()
        worker = start_worker(ServerConfig(max_batch_size=1, api_key=None, gc_freeze=False))
        try:
            assert gc.get_freeze_count() == before and "gc_freeze" not in worker.model.report
        finally:
            worker.stop()


def test_gc_freeze_must_be_a_bool():
    with pytest.raises(ValueError, match="gc_freeze"):
        ServerConfig(gc_freeze="yes")
