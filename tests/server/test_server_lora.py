"""Per-request LoRA through the real HTTP server (tiny FLUX, in process): GET /v1/loras, each request's adapters
(A -> B -> none -> A, two combined) give the image the engine gives for them, batches mix only equal adapter sets
and every image is its solo bytes, bad adapters get a 4xx naming them with the server still serving, and an
out-of-memory request gets a 507 naming its size and adapters while /health stays ready and the next image is
byte-identical."""

from __future__ import annotations

import asyncio
import base64
import weakref

import httpx
import pytest
import torch

from xstage_dit.server.app import create_app
from xstage_dit.server.config import ServerConfig
from tests.helpers.lora import lora_worker, png_of, served_tiny_flux, write_peft
from tests.helpers.server import assert_same_image, decode_png, live_server, one_torch_thread

BODY = {"prompt": "a red cat on a sofa", "seed": 7, "num_inference_steps": 2, "size": "32x32"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, worker, lora dir): tiny FLUX served with --lora-dir, batching every compatible request."""
    lora_dir = tmp_path_factory.mktemp("loras")
    (lora_dir / "corrupt.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    with served_tiny_flux(lora_dir) as (url, worker):
        yield url, worker, lora_dir


def _post_all(url, bodies):
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            return await asyncio.gather(*(client.post("/v1/images/generations", json=b) for b in bodies))

    return asyncio.run(run())


def test_requests_choose_their_adapters(served):
    url, worker, _ = served
    with httpx.Client(base_url=url, timeout=300) as client:
        listed = client.get("/v1/loras").json()
        assert {c["id"]: c["resident"] for c in listed["data"]} == {"a": False, "b": False, "corrupt": False}
        assert listed["max_loras_per_request"] == 2 and listed["hotswap"] is False
        plain = png_of(client.post("/v1/images/generations", json=BODY))
        images = {}
        for key, lora in (("a", [{"name": "a", "scale": 0.7}]), ("b", ["b"]), ("none", []), ("a2", [{"name": "a",
                          "scale": 0.7}]), ("ab", [{"name": "a", "scale": 0.7}, {"name": "b", "scale": -0.5}])):
            images[key] = png_of(client.post("/v1/images/generations", json={**BODY, "lora": lora}))
        listed = {c["id"]: c for c in client.get("/v1/loras").json()["data"]}
    assert images["none"] == plain and images["a2"] == images["a"]
    assert len({images["a"], images["b"], images["ab"], plain}) == 4
    assert listed["a"]["resident"] and listed["a"]["rank"] == 4 and listed["b"]["active_scale"] == -0.5

    # the engine the server runs, called directly with the same adapters: the same pixels (one uint8 level: the
    # server's batch-invariant linear layers may round one pixel differently)
    from xstage_dit.runtime.generation import call_kwargs, output_pixels, run_pipeline

    pipe, spec = worker.model.pipe, worker.model.served
    from xstage_dit.families import model_spec

    kwargs = call_kwargs(pipe, model_spec("tiny-flux"), prompt=BODY["prompt"], seed=7, steps=2, height=32, width=32)
    worker.model.adapters.activate([("a", 0.7), ("b", -0.5)])
    direct = output_pixels(run_pipeline(pipe, **kwargs), "image")[0]
    assert_same_image(decode_png(base64.b64encode(images["ab"]).decode()), direct[..., :3], "served vs engine")
    assert spec.lora is worker.model.adapters


def test_batches_mix_only_equal_adapter_sets_and_each_image_is_its_solo_bytes(served):
    url, _, _ = served
    bodies = [{**BODY, "lora": ["a"]}, {**BODY, "lora": ["b"]}, dict(BODY), {**BODY, "seed": 8, "lora": ["a"]},
              {**BODY, "seed": 9}]
    solo = [png_of(r) for r in [_post_all(url, [b])[0] for b in bodies]]
    crowd = _post_all(url, bodies)
    assert [png_of(r) for r in crowd] == solo
    sizes = [r.json()["batch_size"] for r in crowd]
    assert max(sizes) == 2, sizes  # a batch formed (the two "a" requests, or the two without LoRA), no larger


def test_bad_adapters_get_a_4xx_naming_them_and_the_server_goes_on(served):
    url, _, _ = served
    with httpx.Client(base_url=url, timeout=300) as client:
        before = png_of(client.post("/v1/images/generations", json={**BODY, "lora": ["a"]}))
        cases = [(["nope"], 404, "no adapter 'nope' (available: a, b, corrupt)"),
                 ([{"name": "a", "scale": 9}], 400, "expected a scale in [-4, 4], got 9"),
                 (["a", "b", "a"], 400, "each adapter once"),
                 (["a", "b", "corrupt"], 400, "at most 2 adapters in one request, got 3"),
                 ([{"name": "../a"}], 400, "expected an adapter name (no path)"),
                 (["corrupt"], 400, "adapter 'corrupt': could not be read as a LoRA")]
        for lora, status, words in cases:
            r = client.post("/v1/images/generations", json={**BODY, "lora": lora})
            assert r.status_code == status and words in r.json()["error"]["message"], (lora, r.text)
            assert r.json()["error"]["param"] in ("lora", None)
        assert client.get("/health").status_code == 200
        assert png_of(client.post("/v1/images/generations", json={**BODY, "lora": ["a"]})) == before
        bad = client.post("/v1/images/generations", json={**BODY, "lora": [{"name": "a", "weight": 1}]})
        assert bad.status_code == 422 and "weight" in bad.text


def test_out_of_memory_is_a_507_naming_the_request_and_the_next_image_is_unchanged(served):
    """A test double makes the second transformer block's attention raise torch.OutOfMemoryError once, after taking
    a tensor; what handles it is the server's own path (runner, worker, answer)."""
    url, worker, _ = served
    block = worker.model.pipe.transformer.transformer_blocks[0]
    taken: list = []

    def out_of_memory(module, args):
        held = torch.empty(1 << 20)  # what the failing call had taken
        taken.append(weakref.ref(held))
        handle.remove()
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity "
                                     "of 79.19 GiB of which 1.2 GiB is free. Process 4242 has 41 GiB memory in use.")

    with httpx.Client(base_url=url, timeout=300) as client:
        body = {**BODY, "lora": [{"name": "a", "scale": 0.5}]}
        before = png_of(client.post("/v1/images/generations", json=body))
        handle = block.register_forward_pre_hook(out_of_memory)
        r = client.post("/v1/images/generations", json=body)
        assert r.status_code == 507, r.text
        message = r.json()["error"]["message"]
        assert "out of memory" in message and "32x32" in message and "LoRA a:0.5" in message, message
        assert "GiB" not in message and "Process" not in message and "4242" not in message  # no allocator internals
        assert taken and taken[0]() is None  # what the failed call took is freed
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ready"
        assert png_of(client.post("/v1/images/generations", json=body)) == before


def test_a_video_job_takes_adapters_too(tmp_path):
    """POST /v1/videos (tiny Wan): the job's MP4 with an adapter differs from the one without, and an unknown
    adapter is a 404 before the job is queued."""
    import time

    from xstage_dit.families import load_pipeline

    with one_torch_thread():
        write_peft(load_pipeline("tiny-wan", dtype=torch.float32, device="cpu", seed=0).transformer,
                   tmp_path / "motion.safetensors", rank=4, seed=3)
        worker = lora_worker("tiny-wan", {"lora_dir": str(tmp_path)}, ServerConfig(api_key=None, warmup=False,
                                                                                 max_batch_size=1))
        try:
            with live_server(create_app(worker)) as url, httpx.Client(base_url=url, timeout=300) as client:
                body = {"prompt": "a cat walking", "seed": 1, "num_inference_steps": 2}
                missing = client.post("/v1/videos", json={**body, "lora": ["nope"]})
                assert missing.status_code == 404 and "no adapter 'nope'" in missing.text
                videos = []
                for lora in ([], [{"name": "motion", "scale": 1.5}]):
                    job = client.post("/v1/videos", json={**body, "lora": lora}).json()
                    while client.get(f"/v1/videos/{job['id']}").json()["status"] not in ("completed", "failed"):
                        time.sleep(0.2)
                    content = client.get(f"/v1/videos/{job['id']}/content")
                    assert content.status_code == 200, content.text
                    videos.append(content.content)
                assert videos[0] != videos[1]
        finally:
            worker.stop()
