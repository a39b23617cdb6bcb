"""`xstage-dit serve --sp 2` on the CPU (gloo): two rank processes started by the command itself. The
answer equals the single-process image for the same seed; killing a worker rank mid-request makes
`/health` fail and every pending request end with 503, with no hang, and the server then exits."""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import os
import signal
import time

import pytest

from tests.helpers.server import assert_same_image, decode_png, multirank_server, reference_image, tiny

EXIT_AFTER_FAILURE_S = 3.0


@pytest.fixture(scope="module")
def two_rank_server():
    with multirank_server("--heartbeat-timeout", "5", "--exit-after-failure", str(EXIT_AFTER_FAILURE_S),
                          "--log-level", "warning", "--max-batch-size", "1") as server:
        yield server


def test_two_ranks_answer_with_the_single_process_image(two_rank_server):
    client, _, _ = two_rank_server
    health = client.get("/health").json()
    assert health["world_size"] == 2 and [r["rank"] for r in health["ranks"]] == [0, 1]
    report = client.get("/v1/calibration").json()
    assert report["parallel"]["world_size"] == 2 and "schedules" in report and "calibration" in report
    if importlib.util.find_spec("xstage_dit.features") is not None:
        assert report["parallel"]["mode"] == "parallelized", report["parallel"]  # not two copies of one pipeline
    r = client.post("/v1/images/generations", json={"prompt": "a red cat", "seed": 3, "size": "32x32",
                                                    "num_inference_steps": 2})
    assert r.status_code == 200, r.text
    pipe, served = tiny("tiny-flux")
    assert_same_image(decode_png(r.json()["data"][0]["b64_json"]),
                      reference_image(pipe, served, "a red cat", 3, 32, 32, 2), "2-rank image")


def test_killed_rank_fails_health_and_pending_requests_with_503(two_rank_server):
    client, proc, log = two_rank_server
    rank1_pid = client.get("/health").json()["ranks"][1]["pid"]
    slow = {"size": "1024x1024", "num_inference_steps": 100}
    with cf.ThreadPoolExecutor(2) as pool:
        running = pool.submit(client.post, "/v1/images/generations", json={"prompt": "a", **slow})
        deadline = time.time() + 60
        while client.get("/health").json()["running"] < 1:
            assert time.time() < deadline, "the first request never started"
            time.sleep(0.05)
        waiting = pool.submit(client.post, "/v1/images/generations", json={"prompt": "b", **slow})
        while client.get("/health").json()["queue_depth"] < 1:
            assert time.time() < deadline, "the second request never queued"
            time.sleep(0.05)
        killed_at = time.time()
        os.kill(rank1_pid, signal.SIGKILL)
        first, second = running.result(timeout=30), waiting.result(timeout=30)
    assert first.status_code == 503 and second.status_code == 503, (first.text, second.text)
    assert "rank" in first.json()["error"]["message"] and first.headers.get("retry-after")
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert client.post("/v1/images/generations", json={"prompt": "c", "size": "32x32"}).status_code == 503
    print(f"\nrank 1 killed: pending requests answered 503 after {time.time() - killed_at:.1f} s")
    # After the grace period the server exits non-zero, so a process manager can restart it.
    assert proc.wait(timeout=EXIT_AFTER_FAILURE_S + 30) != 0
