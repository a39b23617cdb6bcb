"""Every HTTP endpoint of the server against the real tiny FLUX pipeline, in one process (world 1):
images equal to the pipeline's own output for their seed, validation errors naming the field, SSE
progress, queue full (429 + Retry-After), cancellation at the next step, client disconnects,
timeouts, auth, metrics."""

from __future__ import annotations

import base64
import json
import socket
import time

import httpx
import pytest
import torch

from xstage_dit.runtime.generation import to_uint8
from xstage_dit.server.app import create_app
from xstage_dit.server.config import ServerConfig
from tests.helpers.server import (assert_same_image, decode_png, live_server, one_torch_thread, reference_image,
                                  start_worker, tiny)

SLOW = {"size": "1024x1024", "num_inference_steps": 100}  # >= 0.2 s per step on a CPU: far longer than any wait here


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def server():
    worker = start_worker(ServerConfig(max_batch_size=4, batch_wait_s=0.01, api_key=None, max_queue=8))
    with live_server(create_app(worker)) as url:
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client, worker
    worker.stop()


@pytest.fixture(scope="module")
def reference():
    return tiny("tiny-flux")


def sse_events(response):
    """(name, data) of each event; the images stream's progress comment lines (": xstage.progress {json}") as
    ("xstage.progress", data)."""
    name = None
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            yield name, json.loads(line[5:])
        elif line.startswith(": xstage.progress "):
            yield "xstage.progress", json.loads(line[len(": xstage.progress "):])


def wait_for(predicate, timeout_s=20.0, what="condition"):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_health_models_calibration_docs_page(server):
    client, worker = server
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ready" and health.json()["world_size"] == 1
    models = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny-flux"] and models[0]["kind"] == "image"
    assert client.get("/v1/calibration").json()["model"] == "tiny-flux"
    assert "/v1/images/generations" in client.get("/openapi.json").json()["paths"]
    assert client.get("/docs").status_code == 200
    page = client.get("/")
    assert page.status_code == 200 and "<progress" in page.text and "/v1/images/generations" in page.text


def test_image_equals_the_pipeline_output_for_its_seed(server, reference):
    client, _ = server
    pipe, served = reference
    r = client.post("/v1/images/generations", json={"prompt": "a red cat", "n": 2, "size": "32x48", "seed": 7,
                                                    "num_inference_steps": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["seed"] for d in body["data"]] == [7, 8] and body["model"] == "tiny-flux"
    assert body["timings"]["total_s"] > 0 and r.headers["x-job-id"] == body["job_id"]
    for item in body["data"]:
        want = reference_image(pipe, served, "a red cat", item["seed"], 32, 48, 2)
        assert_same_image(decode_png(item["b64_json"]), want, f"seed {item['seed']}")
    # A different seed is a different image (the comparison above can fail).
    other = reference_image(pipe, served, "a red cat", 9, 32, 48, 2)
    assert abs(decode_png(body["data"][0]["b64_json"]).astype(int) - other.astype(int)).max() > 1


def test_png_answer_is_the_same_image_as_the_json_one(server, reference):
    """response_format 'png': the body is the PNG the JSON answer carries in base64, byte for byte, with the
    seed, job id and timings in headers; it takes one image and no stream."""
    client, _ = server
    body = {"prompt": "a red cat", "size": "32x48", "seed": 11, "num_inference_steps": 2}
    as_json = client.post("/v1/images/generations", json=body)
    as_png = client.post("/v1/images/generations", json={**body, "response_format": "png"})
    assert as_json.status_code == 200 and as_png.status_code == 200, (as_json.text, as_png.text[:200])
    assert as_png.headers["content-type"] == "image/png" and as_png.headers["x-seed"] == "11"
    assert as_png.content == base64.b64decode(as_json.json()["data"][0]["b64_json"])
    timings = json.loads(as_png.headers["x-timings"])
    assert timings["total_s"] > 0 and timings["encode_s"] is not None, timings
    assert as_png.headers["x-job-id"] != as_json.headers["x-job-id"]
    pipe, served = reference
    assert_same_image(decode_png(base64.b64encode(as_png.content).decode()),
                      reference_image(pipe, served, "a red cat", 11, 32, 48, 2), "png answer")
    for extra, got in (({"n": 2}, "n=2"), ({"stream": True}, "stream=true")):
        r = client.post("/v1/images/generations", json={**body, "response_format": "png", **extra})
        error = r.json()["error"]
        assert r.status_code == 422 and error["param"] == "response_format" and got in error["message"], r.text


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "size": "33x32"}, "size"),
    ({"prompt": "x", "size": "big"}, "size"),
    ({"prompt": "x", "size": "4096x4096"}, "size"),
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
    ({"prompt": "x", "num_inference_steps": 1000}, "num_inference_steps"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "   "}, "prompt"),
    ({"size": "32x32"}, "prompt"),
    ({"prompt": "x", "num_inference_step": 2}, "num_inference_step"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": "two"}, "n"),
    ({"prompt": "x", "response_format": "url"}, "response_format"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "guidance_scale": -1}, "guidance_scale"),
    ({"prompt": "x", "model": "full-flux"}, "model"),
])
def test_validation_errors_name_the_field(server, body, param):
    client, _ = server
    r = client.post("/v1/images/generations", json=body)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


def test_a_streamed_request_listens_before_its_job_is_queued(server, monkeypatch):
    """The stream subscribes to its job before the job is queued, so a first step that runs at once is still
    an event its client gets (a stream on a loaded 2-core CI machine once began at step 3 of 4)."""
    from xstage_dit.server.images import serving as images

    client, _ = server
    listening = []
    real = images.enqueue

    def spy(worker, job):
        listening.append(len(job._subscribers))
        return real(worker, job)

    monkeypatch.setattr(images, "enqueue", spy)
    with client.stream("POST", "/v1/images/generations",
                       json={"prompt": "a cat", "size": "32x32", "num_inference_steps": 2, "stream": True}) as r:
        events = list(sse_events(r))
    assert listening == [1] and events[-1][0] == "image_generation.completed"
    progress = [e["steps_done"] for n, e in events if n == "xstage.progress" and e["status"] == "in_progress"]
    assert progress == [0, 1, 2], events


def test_malformed_json_oversized_body_and_non_object(server):
    client, _ = server
    r = client.post("/v1/images/generations", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body" and "JSON" in r.json()["error"]["message"]
    r = client.post("/v1/images/generations", json={"prompt": "x" * 70000})
    assert r.status_code == 413 and "body" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit applies while reading
        for _ in range(20):
            yield b" " * 8192

    r = client.post("/v1/images/generations", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = client.post("/v1/images/generations", json=["a cat"])
    assert r.status_code == 422 and r.json()["error"]["param"] == "body"
    assert client.post("/v1/videos", json={"prompt": "x"}).json()["error"]["param"] == "model"  # image model


def test_streamed_progress_then_image(server):
    client, _ = server
    with client.stream("POST", "/v1/images/generations",
                       json={"prompt": "a cat", "size": "32x32", "num_inference_steps": 4, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r))
    progress = [e for n, e in events if n == "xstage.progress"]
    assert [p["steps_done"] for p in progress if p["status"] == "in_progress"] == [0, 1, 2, 3, 4]
    name, final = events[-1]
    assert name == "image_generation.completed" and decode_png(final["b64_json"]).shape == (32, 32, 3)
    assert final["type"] == name and final["size"] == "32x32" and final["output_format"] == "png"
    job = client.get(f"/v1/jobs/{final['job_id']}").json()
    assert job["status"] == "completed" and job["steps_done"] == 4
    with client.stream("GET", f"/v1/jobs/{final['job_id']}/events") as r:  # a finished job: its final state
        late = list(sse_events(r))
    assert [n for n, _ in late] == ["progress", "completed"] and late[0][1]["steps_done"] == 4
    assert client.get("/v1/jobs/nope").status_code == 404


def test_cancel_stops_at_next_step_and_frees_the_worker(server):
    client, worker = server
    with client.stream("POST", "/v1/images/generations", json={"prompt": "slow", "stream": True, **SLOW}) as r:
        events = sse_events(r)
        for name, event in events:
            if event.get("steps_done", 0) >= 1:
                break
        job_id = event["job_id"]
        cancelled_at = time.perf_counter()
        assert client.delete(f"/v1/jobs/{job_id}").status_code == 200
        rest = list(events)
    assert rest[-1][0] == "error" and rest[-1][1]["error"]["status"] == "cancelled"
    job = worker.queue.get(job_id)
    assert job.status == "cancelled" and job.steps_done < 10, job.steps_done  # stopped within a step or two
    assert time.perf_counter() - cancelled_at < 5
    t = time.perf_counter()
    assert client.post("/v1/images/generations", json={"prompt": "next", "size": "32x32"}).status_code == 200
    assert time.perf_counter() - t < 5  # the worker was free, not still computing the cancelled job


def test_client_disconnect_cancels_its_job(server):
    client, worker = server
    before = {j.id for j in worker.queue.jobs()}
    body = json.dumps({"prompt": "gone", **SLOW}).encode()
    host, port = client.base_url.host, client.base_url.port
    with socket.create_connection((host, port)) as s:
        s.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        job = wait_for(lambda: next((j for j in worker.queue.jobs() if j.id not in before and j.steps_done >= 1),
                                    None), what="the job to start")
    wait_for(lambda: job.status == "cancelled", 10, "the job to be cancelled after the disconnect")
    assert job.steps_done < job.steps_total
    assert 'reason="client_disconnected"' in client.get("/metrics").text


def test_metrics_exposes_queue_latency_steps_errors(server):
    client, _ = server
    client.post("/v1/images/generations", json={"prompt": "m", "size": "32x32"})
    client.post("/v1/images/generations", json={"prompt": ""})
    text = client.get("/metrics").text
    for name in ("xstage_queue_depth", "xstage_request_latency_seconds_bucket", "xstage_step_seconds_count",
                 'xstage_errors_total{reason="validation"}', "xstage_batch_size_bucket", "xstage_ranks_ready 1.0",
                 'xstage_requests_total{code="200",endpoint="/v1/images/generations"}'):
        assert name in text, name


def test_queue_full_gives_429_with_retry_after_and_timeouts_give_504():
    worker = start_worker(ServerConfig(max_queue=1, max_batch_size=1, batch_wait_s=0, request_timeout_s=1.5,
                                       api_key=None))
    with live_server(create_app(worker)) as url, httpx.Client(base_url=url, timeout=60) as client:
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(2) as pool:
            running = pool.submit(client.post, "/v1/images/generations", json={"prompt": "a", **SLOW})
            wait_for(lambda: worker.queue.running == 1, what="the first job to run")
            waiting = pool.submit(client.post, "/v1/images/generations", json={"prompt": "b", **SLOW})
            wait_for(lambda: worker.queue.depth == 1, what="the second job to queue")
            full = client.post("/v1/images/generations", json={"prompt": "c", "size": "32x32"})
            assert full.status_code == 429 and int(full.headers["retry-after"]) >= 1
            assert full.json()["error"]["param"] is None and "queue" in full.json()["error"]["message"]
            # Both slow jobs exceed the 1.5 s request timeout: the running one stops at a step, the other in the queue.
            assert running.result().status_code == 504 and waiting.result().status_code == 504
        assert client.post("/v1/images/generations", json={"prompt": "d", "size": "32x32"}).status_code == 200
        assert 'xstage_errors_total{reason="timeout"} 2.0' in client.get("/metrics").text
        assert 'xstage_errors_total{reason="queue_full"} 1.0' in client.get("/metrics").text
    worker.stop()


def test_api_key_is_required_on_v1_when_configured():
    worker = start_worker(ServerConfig(api_key="s3cret", max_batch_size=1))
    with live_server(create_app(worker)) as url, httpx.Client(base_url=url, timeout=60) as client:
        assert client.get("/health").status_code == 200
        r = client.get("/v1/models")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = client.post("/v1/images/generations", json={"prompt": "k", "size": "32x32"},
                         headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
    worker.stop()


def test_negative_prompt_with_true_cfg_matches_the_pipeline(server, reference):
    client, _ = server
    pipe, served = reference
    body = {"prompt": "a red cat", "negative_prompt": "blue", "true_cfg_scale": 2.0, "n": 2, "size": "32x32",
            "seed": 21, "num_inference_steps": 2}
    r = client.post("/v1/images/generations", json=body)
    assert r.status_code == 200, r.text
    for item in r.json()["data"]:
        out = pipe("a red cat", negative_prompt="blue", true_cfg_scale=2.0, height=32, width=32,
                   num_inference_steps=2, guidance_scale=served.default_guidance, output_type="np",
                   generator=torch.Generator("cpu").manual_seed(item["seed"]), **served.pipeline_kwargs)
        assert_same_image(decode_png(item["b64_json"]), to_uint8(out.images[0]), f"true CFG seed {item['seed']}")
    plain = reference_image(pipe, served, "a red cat", 21, 32, 32, 2)
    assert abs(decode_png(r.json()["data"][0]["b64_json"]).astype(int) - plain.astype(int)).max() > 1


@pytest.mark.parametrize("sizes", [[1], [2, 3], [49152, 49153, 100_001]])
def test_the_json_answer_written_once_equals_the_payload(sizes):
    """`image_json` (the non-streamed b64_json body, written into one buffer) says what `image_payload` says, for
    several images and PNG lengths on every side of base64's 3-byte groups and of its 48 KB chunks."""
    import os
    import types

    from xstage_dit.runtime.generation import GenerationRequest
    from xstage_dit.server.job_queue import COMPLETED, Job
    from xstage_dit.server.images.protocol import ImageJobSpec
    from xstage_dit.server.images.serving import image_json, image_payload
    from xstage_dit.server.media import ImageEncoding

    job = Job(id="img-test", deadline=time.time() + 60,
              items=[GenerationRequest(kind="image", prompt="x", width=32, height=32, steps=2, guidance=3.5, seed=s)
                     for s in range(len(sizes))])
    job.results, job.batch_size = [os.urandom(n) for n in sizes], len(sizes)
    job.started, job.finished, job.status = job.created + 0.01, job.created + 0.5, COMPLETED
    worker = types.SimpleNamespace(served=types.SimpleNamespace(name="tiny-flux", size_multiple=16))
    spec = ImageJobSpec(job.items, ImageEncoding(), 0, "high", None)
    body = bytes(image_json(worker, job, spec))
    assert json.loads(body) == image_payload(worker, job, spec)
    assert [base64.b64decode(d["b64_json"]) for d in json.loads(body)["data"]] == job.results
