"""Load test: 50 concurrent image requests against the tiny model, batched. Every request is answered,
each with the image its (prompt, seed) determines: none lost, none swapped. Prints p50/p99 latency and
throughput."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest
import torch

from xstage_dit.runtime.generation import to_uint8
from xstage_dit.server.app import create_app
from xstage_dit.server.config import ServerConfig
from tests.helpers.server import (assert_same_image, decode_png, live_server, one_torch_thread, reference_image,
                                  start_worker, tiny)

NUM_REQUESTS = 50
PROMPTS = ["a red cat", "a blue dog", "a photo of grass", "the sofa", "a cat on a sofa"]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    with one_torch_thread():
        yield


def test_fifty_concurrent_requests_each_get_their_own_image():
    # batching "always": this test is about batches (the batcher may keep such requests apart otherwise).
    worker = start_worker(ServerConfig(max_queue=NUM_REQUESTS, max_batch_size=8, batch_wait_s=0.02, api_key=None,
                                       batching="always"))
    requests = [{"prompt": PROMPTS[i % len(PROMPTS)], "seed": 1000 + 17 * i, "size": "32x32",
                 "num_inference_steps": 2} for i in range(NUM_REQUESTS)]

    async def one(client, body):
        started = time.perf_counter()
        r = await client.post("/v1/images/generations", json=body)
        return body, r, time.perf_counter() - started

    async def all_at_once(url):
        limits = httpx.Limits(max_connections=NUM_REQUESTS)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, body) for body in requests))

    with live_server(create_app(worker)) as url:
        started = time.perf_counter()
        results = asyncio.run(all_at_once(url))
        wall = time.perf_counter() - started
    worker.stop()

    assert len(results) == NUM_REQUESTS
    assert all(r.status_code == 200 for _, r, _ in results), [r.text for _, r, _ in results if r.status_code != 200]
    latencies = np.array([t for _, _, t in results])
    batch_sizes = [r.json()["batch_size"] for _, r, _ in results]
    print(f"\nload test: {NUM_REQUESTS} concurrent requests (32x32, 2 steps, batches up to 8): "
          f"p50 {np.percentile(latencies, 50) * 1e3:.0f} ms, p99 {np.percentile(latencies, 99) * 1e3:.0f} ms, "
          f"throughput {NUM_REQUESTS / wall:.1f} images/s, mean batch {np.mean(batch_sizes):.1f}")
    assert max(batch_sizes) > 1, "compatible concurrent requests were never batched"

    # References: the 50 (prompt, seed) pairs in one direct pipeline call with one generator each, and
    # three of them alone (the batched call itself must equal single calls).
    pipe, served = tiny("tiny-flux")
    out = pipe([b["prompt"] for b in requests], height=32, width=32, num_inference_steps=2,
               guidance_scale=served.default_guidance, output_type="np",
               generator=[torch.Generator("cpu").manual_seed(b["seed"]) for b in requests], **served.pipeline_kwargs)
    batched = {b["seed"]: to_uint8(np.asarray(img)) for b, img in zip(requests, out.images)}
    for body in requests[:3]:
        single = reference_image(pipe, served, body["prompt"], body["seed"], 32, 32, 2)
        assert_same_image(batched[body["seed"]], single, f"direct batched vs single, seed {body['seed']}")
    for body, r, _ in results:
        data = r.json()["data"]
        assert len(data) == 1 and data[0]["seed"] == body["seed"]
        assert_same_image(decode_png(data[0]["b64_json"]), batched[body["seed"]], f"request seed {body['seed']}")
    distinct = {batched[b["seed"]].tobytes() for b in requests}
    assert len(distinct) == NUM_REQUESTS  # every request has its own image: a swap could not go unseen
