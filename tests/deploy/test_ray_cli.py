"""`xstage-dit serve --replicas 1` end to end: the command starts a local Ray cluster, runs the application, answers
like ``xstage-dit serve`` (plus the replica header), and on SIGTERM deletes the application and exits 0."""

from __future__ import annotations

import signal
import time

import pytest

from tests.helpers.ray_cluster import replica_of
from tests.helpers.server import multirank_server

pytestmark = pytest.mark.slow


def test_serve_with_replicas_starts_ray_answers_and_stops_cleanly():
    started = time.monotonic()
    with multirank_server("--replicas", "1", "--gpus-per-rank", "0", "--no-warmup", "--log-level", "warning",
                          sp=1, log_name="serve-replicas", ready_within_s=240) as (client, proc, log):
        ready_s = time.monotonic() - started
        health = client.get("/health").json()
        assert health["ready_replicas"] == 1 and health["replica"] == replica_of(client.get("/health"))
        r = client.post("/v1/images/generations", json={"prompt": "a red fox", "seed": 3, "size": "32x32",
                                                        "num_inference_steps": 2})
        assert r.status_code == 200 and r.json()["data"][0]["seed"] == 3 and replica_of(r) == health["replica"]
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        log.seek(0)
        assert code == 0, log.read()[-3000:]
    print(f"\nxstage-dit serve --replicas 1: ready in {ready_s:.1f} s, stopped cleanly")
