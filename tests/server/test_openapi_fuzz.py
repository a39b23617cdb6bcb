"""OpenAPI fuzzing of the tiny server with schemathesis: every operation of /openapi.json, valid and
invalid inputs, checked for server errors (no 5xx), response schema conformance and documented status
codes. The examples per operation are bounded (and the server's limits kept small, so a valid request
is a tiny generation), which keeps the run under a minute on a 2-core machine. A summary (requests per
operation, statuses, failures) goes to out/openapi-fuzz.json and the test's output."""

from __future__ import annotations

import collections
import contextlib
import json
from pathlib import Path

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, response_schema_conformance, status_code_conformance

from xstage_dit.server.app import create_app
from xstage_dit.server.config import ServerConfig
from tests.helpers.server import live_server, one_torch_thread, start_worker

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {GenerationMode.POSITIVE: 12, GenerationMode.NEGATIVE: 8}
CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance]
# Small limits: the fuzzer's valid requests stay tiny generations (seconds in all on a CPU).
FUZZ_CONFIG = ServerConfig(max_batch_size=1, api_key=None, max_steps=2, max_size=64, max_pixels=64 * 64, max_n=1,
                           max_frames=9, request_timeout_s=120)


@contextlib.contextmanager
def _server(model: str):
    with one_torch_thread():
        worker = start_worker(FUZZ_CONFIG, model=model)
        try:
            with live_server(create_app(worker)) as url:
                yield url
        finally:
            worker.stop()


@pytest.fixture(scope="module")
def base_url():
    with _server("tiny-flux") as url:
        yield url


def test_every_operation_survives_fuzzing(base_url):
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    session = requests.Session()
    statuses: dict[str, collections.Counter] = {}
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10, [op.label for op in operations]
    for operation in operations:
        seen = statuses.setdefault(operation.label, collections.Counter())
        for mode, examples in EXAMPLES.items():
            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def fuzz(case):
                try:
                    response = case.call_and_validate(base_url=base_url, session=session, checks=CHECKS,
                                                      timeout=120)
                    seen[response.status_code] += 1
                except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - collected, reported together
                    failures.append(f"{operation.label} ({mode.value}): {str(exc).strip()[:600]}")

            try:
                fuzz()
            except Unsatisfiable:
                # No invalid input exists for an operation without parameters (GET /health).
                assert mode is GenerationMode.NEGATIVE, operation.label
    # Random inputs rarely make a valid generation: check the successful answers on purpose too, and
    # the job operations on a job that exists.
    by_label = {op.label: op for op in operations}
    image = by_label["POST /v1/images/generations"]
    job_id = None
    for body in ({"prompt": "a red fox", "size": "32x32", "num_inference_steps": 1, "seed": 1},
                 {"prompt": "a red fox", "size": "32x32", "num_inference_steps": 2, "seed": 2, "stream": True}):
        response = image.Case(body=body, media_type="application/json").call_and_validate(
            base_url=base_url, session=session, checks=CHECKS, timeout=120)
        assert response.status_code == 200, response.text[:300]
        statuses[image.label][200] += 1
        job_id = job_id or response.json()["job_id"]
    # a completed job's cancel comes too late: 409 with its state
    for label, status in (("GET /v1/jobs/{job_id}", 200), ("GET /v1/jobs/{job_id}/events", 200),
                          ("DELETE /v1/jobs/{job_id}", 409)):
        response = by_label[label].Case(path_parameters={"job_id": job_id}).call_and_validate(
            base_url=base_url, session=session, checks=CHECKS, timeout=120)
        assert response.status_code == status, (label, response.text[:300])
        statuses[label][status] += 1
    assert response.json()["job"]["status"] == "completed"
    model = by_label["GET /v1/models/{model_id}"].Case(path_parameters={"model_id": "tiny-flux"}).call_and_validate(
        base_url=base_url, session=session, checks=CHECKS, timeout=120)
    assert model.status_code == 200 and model.json()["id"] == "tiny-flux"
    summary = {"operations": len(operations), "requests": sum(sum(c.values()) for c in statuses.values()),
               "server_errors": sum(n for c in statuses.values() for s, n in c.items() if s >= 500),
               "failures": len(failures),
               "statuses": {label: dict(sorted(c.items())) for label, c in statuses.items()}}
    out = ROOT / "out" / "openapi-fuzz.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({**summary, "failure_messages": failures}, indent=1))
    print("\nschemathesis summary:", json.dumps(summary, indent=1))
    assert not failures, "\n\n".join(failures[:10])
    assert summary["server_errors"] == 0


def test_video_job_answers_conform_to_the_schema():
    # The image server above answers the video operations with 400/404 only: a video server's
    # successful answers (202, the job, its events, the MP4, the cancel) are checked here.
    with _server("tiny-wan") as url:
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        ops = {result.ok().label: result.ok() for result in schema.get_all_operations()}
        session = requests.Session()

        def call(label, status, **case):
            response = ops[label].Case(**case).call_and_validate(base_url=url, session=session, checks=CHECKS,
                                                                 timeout=120)
            assert response.status_code == status, (label, response.status_code, response.text[:300])
            return response

        job = call("POST /v1/videos", 202, body={"prompt": "a cat", "size": "32x32", "num_frames": 5,
                                                   "num_inference_steps": 2, "seed": 1},
                   media_type="application/json").json()
        form = call("POST /v1/videos", 202, body={"prompt": "a dog", "size": "32x32", "seconds": "0.25",
                                                    "num_inference_steps": 1}, media_type="multipart/form-data")
        assert form.json()["num_frames"] == 5
        path = {"video_id": job["id"]}
        call("GET /v1/videos/{video_id}/events", 200, path_parameters=path)  # ends when the job does
        assert call("GET /v1/videos/{video_id}", 200, path_parameters=path).json()["status"] == "completed"
        assert call("GET /v1/videos/{video_id}/content", 200, path_parameters=path).content[4:8] == b"ftyp"
        for variant, magic in (("thumbnail", b"\x89PNG"), ("spritesheet", b"\xff\xd8\xff")):
            got = call("GET /v1/videos/{video_id}/content", 200, path_parameters=path, query={"variant": variant})
            assert got.content.startswith(magic), variant
        assert job["id"] in [v["id"] for v in call("GET /v1/videos", 200, query={"limit": 5}).json()["data"]]
        call("DELETE /v1/videos/{video_id}", 200, path_parameters=path)
