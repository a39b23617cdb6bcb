"""The server with a step cache (`xstage_dit.server.step_cache`): each answer's ``timings.step_cache`` counts what
its request computed and skipped, ``/metrics`` adds them up, every request runs alone and its image is the one
the cached pipeline gives for that request alone, a request's ``cache_threshold`` applies to it only (and is
refused, naming the field, where no threshold applies), with the official OpenAI SDK as the client (the field
through ``extra_body``). On two ranks (``xstage-dit serve --sp 2 --cache ...``): the one-process image."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from xstage_dit.features import ParallelConfig
from xstage_dit.features.step_cache import StepCacheConfig
from xstage_dit.runtime.generation import GenerationRequest, to_uint8
from xstage_dit.server.app import create_app
from xstage_dit.server.config import ServerConfig
from xstage_dit.server.startup import model_loader
from xstage_dit.server.worker import Worker
from tests.helpers.server import assert_same_image, live_server, multirank_server, one_torch_thread

STEPS = 4


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    with one_torch_thread():
        yield


def _served(cache: StepCacheConfig):
    from xstage_dit.server.ranks import RankContext

    loader = model_loader("tiny-flux", ParallelConfig(), features={"cache": cache})
    worker = Worker(loader, ServerConfig(api_key=None, max_batch_size=4, batch_wait_s=0.05, batching="always"),
                    join=lambda: RankContext(device=torch.device("cpu"))).start()
    assert worker.wait_ready(300), worker.reason
    return worker


@pytest.fixture(scope="module")
def forced():
    worker = _served(StepCacheConfig("fbcache", compute_every=2))
    with live_server(create_app(worker)) as url:
        yield url, worker
    worker.stop()


def _reference(cache: StepCacheConfig, seed: int, threshold=None) -> np.ndarray:
    """The cached pipeline called directly for one image, as `generate` runs it (uint8)."""
    from xstage_dit.engine import Engine, EngineConfig
    from xstage_dit.features.step_cache import cache_request
    from xstage_dit.runtime.generation import call_kwargs, run_pipeline
    from xstage_dit.families import model_spec

    with Engine(EngineConfig(model="tiny-flux", device="cpu", cache=cache)) as engine:
        engine.apply(engine.load())
        pipe = engine.pipe
        kwargs = call_kwargs(pipe, model_spec("tiny-flux"), prompt="a fox", seed=seed, steps=STEPS)
        with cache_request(pipe, steps=STEPS, threshold=threshold):
            out = run_pipeline(pipe, **{**kwargs, "output_type": "np"})
    return to_uint8(np.asarray(out.images[0]))


def _pixels(b64: str) -> np.ndarray:
    return np.array(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def test_answers_count_computed_and_skipped_steps_and_metrics_add_them_up(forced):
    import httpx

    url, worker = forced
    r = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a fox", "seed": 3, "n": 2,
                                                         "num_inference_steps": STEPS}, timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    # n=2 is two requests' worth of work, each image alone (the batcher runs a caching server's requests alone)
    decision = worker.batcher.decision(GenerationRequest("image", "a fox", 128, 128, STEPS, 3.5).batch_key)
    assert body["batch_size"] == 2 and not decision.batch and "step cache fbcache" in decision.reason
    assert body["timings"]["step_cache"] == {"method": "fbcache", "unit": "steps", "computed": 4, "skipped": 4}
    want = _reference(StepCacheConfig("fbcache", compute_every=2), seed=3)
    assert_same_image(_pixels(body["data"][0]["b64_json"]), want)
    metrics = httpx.get(f"{url}/metrics").text
    assert 'xstage_step_cache_computed_total{method="fbcache",unit="steps"} 4.0' in metrics
    assert 'xstage_step_cache_skipped_total{method="fbcache",unit="steps"} 4.0' in metrics
    report = httpx.get(f"{url}/v1/calibration").json()
    assert report["step_cache"]["method"] == "fbcache" and report["step_cache"]["compute_every"] == 2


def test_a_threshold_where_none_applies_is_refused_by_name(forced):
    url, _ = forced
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError, match="cache_threshold: the server's step cache fbcache decides "
                                                     "without a threshold"):
        client.images.generate(prompt="a fox", extra_body={"cache_threshold": 0.1, "num_inference_steps": STEPS})


def test_a_request_threshold_applies_to_that_request_alone():
    cache = StepCacheConfig("fbcache", threshold=1e9)  # every step after the first skipped
    worker = _served(cache)
    try:
        with live_server(create_app(worker)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
            common = dict(prompt="a fox", extra_body={"seed": 5, "num_inference_steps": STEPS})
            never = client.images.generate(**{**common, "extra_body": {**common["extra_body"], "cache_threshold": 0}})
            default = client.images.generate(**common)
            bad = client.with_options(max_retries=0)
            with pytest.raises(openai.UnprocessableEntityError, match="cache_threshold: expected a number in"):
                bad.images.generate(**{**common, "extra_body": {**common["extra_body"], "cache_threshold": -1}})
    finally:
        worker.stop()
    assert never.model_extra["timings"]["step_cache"]["skipped"] == 0
    assert default.model_extra["timings"]["step_cache"] == {"method": "fbcache", "unit": "steps", "computed": 1,
                                                            "skipped": STEPS - 1}
    assert_same_image(_pixels(never.data[0].b64_json), _reference(cache, seed=5, threshold=0.0))
    assert_same_image(_pixels(default.data[0].b64_json), _reference(cache, seed=5))


def test_without_a_step_cache_a_threshold_is_refused_and_timings_say_none():
    from xstage_dit.server.config import ServedModel
    from xstage_dit.server.protocol import RequestError
    from xstage_dit.server.videos.protocol import VideoCreateRequest, video_params

    served = ServedModel(name="v", kind="video", size_multiple=16, default_width=32, default_height=32,
                         default_steps=2, default_guidance=5.0, default_frames=5)
    with pytest.raises(RequestError, match="cache_threshold: this server runs no step cache"):
        video_params(VideoCreateRequest(prompt="a cat", cache_threshold=0.1), served, ServerConfig(api_key=None))
    assert video_params(VideoCreateRequest(prompt="a cat"), served, ServerConfig(api_key=None)).cache_threshold is None


@pytest.mark.slow  # two ranks start and warm up: about 40 s on the 2-core machine
def test_two_ranks_serve_the_one_process_cached_image():
    with multirank_server("--cache", "fbcache", "--cache-compute-every", "2", "--max-batch-size", "1",
                          sp=2, log_name="serve-cache", client_timeout_s=300) as (client, _, _):
        r = client.post("/v1/images/generations", json={"prompt": "a fox", "seed": 3, "num_inference_steps": STEPS})
        assert r.status_code == 200, r.text
        body = r.json()
    assert body["timings"]["step_cache"] == {"method": "fbcache", "unit": "steps", "computed": 2, "skipped": 2}
    assert_same_image(_pixels(body["data"][0]["b64_json"]), _reference(StepCacheConfig("fbcache", compute_every=2),
                                                                       seed=3))
