"""Issue 16, items 4-8 against the real tiny pipelines: the random-weights notice (start-up, /v1/models),
the API key (a start-up curl line that works as printed), one error envelope with "expected X, got Y",
offline API docs and a favicon, and quiet prompt truncation."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from xstage_dit.families import load_pipeline, model_spec
from xstage_dit.runtime.generation import call_kwargs
from xstage_dit.server.announce import ready_lines
from xstage_dit.server.app import create_app
from xstage_dit.server.config import ServedModel, ServerConfig
from xstage_dit.server.images.protocol import ImageGenerationRequest, image_params
from xstage_dit.server.protocol import RequestError
from tests.helpers.server import free_port, live_server, one_torch_thread, start_worker

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def client():
    worker = start_worker(ServerConfig(max_batch_size=1, api_key=None))
    try:
        with live_server(create_app(worker)) as url, httpx.Client(base_url=url, timeout=60) as c:
            yield c
    finally:
        worker.stop()


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == status
    return body["error"]


# ---- item 4: random weights, said at start-up, in /v1/models and (see test_webpage.py) on the page

def test_models_say_the_weights_are_random_and_how_to_use_real_ones(client):
    card = client.get("/v1/models").json()["data"][0]
    assert card["random_weights"] is True
    assert "random weights" in card["weights_notice"] and "--model /path/to/FLUX.1-dev" in card["weights_notice"]


def test_a_local_folder_has_no_notice(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    spec = model_spec(str(tmp_path))
    assert spec.random_weights is False and spec.weights_notice is None
    assert ServedModel.from_spec("mine", spec).weights_notice is None


# ---- item 5: the start-up lines; with a key, the printed curl line works as printed

def test_ready_lines_carry_the_notice_and_the_authorization_header():
    served = ServedModel.from_spec("tiny-flux", model_spec("tiny-flux"))
    plain = ready_lines(served, "http://127.0.0.1:8000", 1, needs_key=False)
    keyed = ready_lines(served, "http://127.0.0.1:8000", 1, needs_key=True)
    assert sum("random weights" in line for line in plain) == 1
    assert "Authorization" not in plain[-1]
    assert '-H "Authorization: Bearer $XSTAGE_API_KEY"' in keyed[-1]


def test_serve_with_a_key_prints_a_curl_line_that_works(tmp_path):
    port, key = free_port(), "s3cret-key"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XSTAGE_API_KEY": key, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    log = tmp_path / "serve.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "xstage_dit", "serve", "--model", "tiny-flux", "--port",
                                 str(port), "--no-warmup", "--log-level", "warning"], stdout=sink, stderr=sink,
                                env=env, cwd=ROOT)
    try:
        deadline = time.time() + 120
        while "serve: try" not in log.read_text():
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(0.2)
        text = log.read_text()
        assert text.count("random weights") == 1, text  # said once at start-up
        assert key not in text  # the key itself is never printed
        curl = text.split("serve: try  ", 1)[1].splitlines()[0]
        done = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, env=env, timeout=120)
        answer = json.loads(done.stdout)
        assert "data" in answer and answer["data"][0]["b64_json"], done.stdout[:300]
        without = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120,
                                 env={**env, "XSTAGE_API_KEY": "wrong"})
        assert json.loads(without.stdout)["error"]["code"] == 401
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---- item 6: one error envelope, "expected X, got Y" said once, param named

def test_unknown_path_and_wrong_method_use_the_envelope(client):
    error = _error(client.get("/v1/nothing-here"), 404)
    assert error["param"] == "path" and "/v1/nothing-here" in error["message"]
    error = _error(client.get("/v1/images/generations"), 405)
    assert error["param"] == "method" and "POST" in error["message"] and "got GET" in error["message"]


def test_a_body_that_is_not_json_gets_415(client):
    r = client.post("/v1/images/generations", content=b"prompt=a cat", headers={"Content-Type": "text/plain"})
    error = _error(r, 415)
    assert error["param"] == "content-type" and "application/json" in error["message"] and "text/plain" in error["message"]
    # JSON with a charset, or no Content-Type at all, is still JSON
    ok = client.post("/v1/images/generations", content=json.dumps({"prompt": "x", "n": 0}).encode(),
                     headers={"Content-Type": "application/json; charset=utf-8"})
    assert _error(ok, 422)["param"] == "n"


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": "x", "size": "100000x100000"}, "size", "size: expected width in [16, 2048], got 100000"),
    ({"prompt": "x", "size": "64x" + "9" * 5000}, "size",
     "size: expected height in [16, 2048], got 999999999999999999... (5000 digits)"),
    ({"prompt": "x", "n": 4.5}, "n", "n: expected an integer, got 4.5"),
    ({"prompt": "x", "n": "two"}, "n", "n: expected an integer, got 'two'"),
    ({"prompt": "x", "stream": "maybe"}, "stream", "stream: expected true or false, got 'maybe'"),
    ({"prompt": "x", "response_format": "jpg"}, "response_format",
     "response_format: expected 'b64_json', 'png' or 'url', got 'jpg'"),
    ({"prompt": 3}, "prompt", "prompt: expected a string, got 3"),
])
def test_messages_say_expected_and_got_once(client, body, param, message):
    error = _error(client.post("/v1/images/generations", json=body), 422)
    assert error["param"] == param and error["message"] == message
    assert error["message"].count("got") == 1


def test_job_errors_name_the_id(client):
    error = _error(client.get("/v1/jobs/img_nope"), 404)
    assert error["param"] == "id" and error["message"].startswith("id: ")
    error = _error(client.get("/v1/videos/video_nope"), 404)
    assert error["param"] == "id"


def test_an_image_request_to_a_video_model_says_an_image_model():
    served = ServedModel.from_spec("tiny-wan", model_spec("tiny-wan"))
    with pytest.raises(RequestError) as info:
        image_params(ImageGenerationRequest(prompt="x"), served, ServerConfig(api_key=None))
    assert "expected an image model" in info.value.message


def test_a_one_step_job_has_a_mean_step_time(client):
    r = client.post("/v1/images/generations", json={"prompt": "x", "size": "32x32", "num_inference_steps": 1})
    timings = r.json()["timings"]
    assert timings["mean_step_s"] is not None and 0 < timings["mean_step_s"] <= timings["run_s"]


def test_openapi_summaries_are_whole_sentences(client):
    spec = client.get("/openapi.json").json()
    assert spec["info"]["version"] == __import__("xstage_dit").__version__
    health = spec["paths"]["/health"]["get"]["summary"]
    assert "200" in health and "503" in health, health


# ---- item 7: favicon and offline docs

def test_favicon_is_served(client):
    r = client.get("/favicon.ico")
    assert r.status_code == 200 and r.headers["content-type"] == "image/x-icon" and r.content[:4] == b"\0\0\1\0"
    assert '<link rel="icon" href="/favicon.ico">' in client.get("/").text


def test_api_docs_need_no_internet(client):
    page = client.get("/docs").text
    urls = re.findall(r'(?:src|href)=["\']([^"\']+)', page) + re.findall(r"url: ?['\"]([^'\"]+)", page)
    assert urls and all(u.startswith("/") for u in urls), urls  # nothing from a CDN
    for url in urls:
        r = client.get(url)
        assert r.status_code == 200, (url, r.status_code)
    js = next(u for u in urls if u.endswith("swagger-ui-bundle.js"))
    assert len(client.get(js).content) > 100_000  # the real Swagger UI, not a placeholder


# ---- item 8: long and non-Latin prompts leave one short line per cut, no cut-off text, no <unk>

class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-hidream"])
def test_prompt_truncation_is_one_short_line(model):
    pipe = load_pipeline(model, seed=0)
    spec = model_spec(model)
    records = _Records()
    loggers = [logging.getLogger(type(pipe).__module__), logging.getLogger("transformers.tokenization_utils_base")]
    for logger in loggers:
        logger.addHandler(records)
    try:
        prompt = "雪の中の赤いキツネ、夕日、高品質の写真 " * 40 + "a red fox in the snow " * 30
        pipe(**call_kwargs(pipe, spec, prompt=prompt, negative_prompt=None, height=32, width=32, frames=1, steps=1,
                           guidance=None, seed=0))
    finally:
        for logger in loggers:
            logger.removeHandler(records)
    assert records.messages, "expected the truncation to be reported"
    for message in records.messages:
        assert "<unk>" not in message and "キツネ" not in message and "fox" not in message, message
        assert len(message) < 100 and re.fullmatch(r"prompt truncated to its first \d+ tokens \(.+\)", message), message
