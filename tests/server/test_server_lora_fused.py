"""A server in fused LoRA mode (``--lora-mode fused``; tiny FLUX, in process): A -> B -> none -> A gives each
adapter set diffusers' own fused image (``set_adapters`` + ``fuse_lora``), "none" the bytes of the request without
LoRA, GET /v1/loras says the mode in use, and batches of mixed adapter sets keep every image its solo bytes."""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest
import torch

from tests.helpers.lora import diffusers_fused_references, png_of, served_tiny_flux
from tests.helpers.server import assert_same_image, decode_png, one_torch_thread, reference_image

BODY = {"prompt": "a red cat on a sofa", "seed": 7, "num_inference_steps": 2, "size": "32x32"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, worker, lora dir): tiny FLUX served with --lora-dir and --lora-mode fused, batching every compatible
    request."""
    lora_dir = tmp_path_factory.mktemp("loras")
    with served_tiny_flux(lora_dir, lora_mode="fused") as (url, worker):
        yield url, worker, lora_dir


def test_a_fused_server_gives_each_set_diffusers_fused_image_and_none_the_plain_bytes(served):
    url, worker, lora_dir = served
    from xstage_dit.families import load_pipeline

    with httpx.Client(base_url=url, timeout=300) as client:
        listed = client.get("/v1/loras").json()
        assert listed["mode"] == "fused" and listed["mode_in_use"] is None, listed
        plain = png_of(client.post("/v1/images/generations", json=BODY))
        images, modes = {}, {}
        for key, lora in (("a", [{"name": "a", "scale": 0.7}]), ("b", ["b"]), ("none", []),
                          ("a2", [{"name": "a", "scale": 0.7}]),
                          ("ab", [{"name": "a", "scale": 0.7}, {"name": "b", "scale": -0.5}])):
            images[key] = png_of(client.post("/v1/images/generations", json={**BODY, "lora": lora}))
            modes[key] = client.get("/v1/loras").json()["mode_in_use"]
        rows = {c["id"]: c for c in client.get("/v1/loras").json()["data"]}
    assert images["none"] == plain and images["a2"] == images["a"]
    assert len({images["a"], images["b"], images["ab"], plain}) == 4
    assert modes == {"a": "fused", "b": "fused", "none": None, "a2": "fused", "ab": "fused"}, modes
    assert rows["a"]["mode"] == rows["b"]["mode"] == "fused" and rows["b"]["active_scale"] == -0.5

    # diffusers' own fused images of the same requests (one uint8 level: the server's batch-invariant linear layers
    # and cached empty prompt move the floats by ~1e-6)
    served_model = worker.model.served
    with one_torch_thread():
        ref = load_pipeline("tiny-flux", dtype=torch.float32, device="cpu", seed=0)
        ref.load_lora_weights(str(lora_dir / "a.safetensors"), adapter_name="a")
        ref.load_lora_weights(str(lora_dir / "b.safetensors"), adapter_name="b")
        want = diffusers_fused_references(
            ref, "tiny-flux", (("a", ["a"], [0.7]), ("b", ["b"], [1.0]), ("ab", ["a", "b"], [0.7, -0.5])),
            render=lambda pipe: reference_image(pipe, served_model, BODY["prompt"], 7, 32, 32, 2))
    for key in ("a", "b", "ab"):
        assert_same_image(decode_png(base64.b64encode(images[key]).decode()), want[key], key)


def test_fused_batches_mix_only_equal_adapter_sets_and_each_image_is_its_solo_bytes(served):
    url, _, _ = served

    async def post_all(bodies):
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            return await asyncio.gather(*(client.post("/v1/images/generations", json=b) for b in bodies))

    bodies = [{**BODY, "lora": ["a"]}, {**BODY, "lora": ["b"]}, dict(BODY), {**BODY, "seed": 8, "lora": ["a"]},
              {**BODY, "seed": 9}]
    solo = [png_of(asyncio.run(post_all([b]))[0]) for b in bodies]
    crowd = asyncio.run(post_all(bodies))
    assert [png_of(r) for r in crowd] == solo
    sizes = [r.json()["batch_size"] for r in crowd]
    assert max(sizes) == 2, sizes  # a batch formed (the two "a" requests, or the two without LoRA), no larger
