"""The official OpenAI SDK (openai 3.63, the test extra) against the real server: ``images.edit`` with one image,
several images (FLUX.2 references, sent as ``image[]``) and a mask, each answer parsed by the SDK's own types and
equal to the pipeline's output; a refused edit raises the SDK's error naming the field. And an adversarial load:
50 concurrent edits, each with its own seed's image, each answer equal to its solo run."""

from __future__ import annotations

import base64
import contextlib
import io
import threading

import httpx
import numpy as np
import openai  # the test extra pins it; the server code never imports it
import pytest
from PIL import Image

from xstage_dit.server.app import create_app
from xstage_dit.server.config import ServerConfig
from tests.helpers.family_harness import seeded_image
from tests.helpers.server import assert_same_image, live_server, one_torch_thread, start_worker



def _file(image: Image.Image, name: str) -> tuple[str, bytes, str]:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return name, buf.getvalue(), "image/png"


@contextlib.contextmanager
def sdk(model: str, **config):
    """(the SDK's client, the worker) of a live server of `model`."""
    with one_torch_thread():
        worker = start_worker(ServerConfig(api_key=None, warmup=False, **{"max_batch_size": 1, **config}), model)
        try:
            with live_server(create_app(worker)) as url:
                yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300), worker
        finally:
            worker.stop()


def _pixels(item) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(item.b64_json))).convert("RGB"))


def _direct(worker, model: str, images, seed: int, steps: int, mask=None, **size) -> np.ndarray:
    from xstage_dit.families import model_spec
    from xstage_dit.runtime.generation import fixed_kwargs, output_pixels, pipeline_kwargs, request_for

    spec = model_spec(model)
    request = request_for(spec, prompt="make it snow", seed=seed, steps=steps, images=images, mask=mask, **size)
    pipe = worker.model.pipe
    return output_pixels(pipe(**pipeline_kwargs(pipe, [request], kind=spec.kind, fixed=fixed_kwargs(spec))),
                         spec.kind)[0]


def test_sdk_edit_with_one_image():
    image = seeded_image(1, 96, 64)
    with sdk("tiny-flux-kontext") as (client, worker):
        resp = client.images.edit(model="tiny-flux-kontext", image=_file(image, "fox.png"), prompt="make it snow",
                                  n=2, size="96x64", response_format="b64_json",
                                  extra_body={"seed": 11, "num_inference_steps": 2})
        assert isinstance(resp, openai.types.ImagesResponse) and isinstance(resp.created, int)
        assert len(resp.data) == 2 and all(isinstance(d, openai.types.Image) for d in resp.data)
        want = _direct(worker, "tiny-flux-kontext", [image], 11, 2)
        assert_same_image(_pixels(resp.data[0]), want, "SDK edit vs pipeline")
        with pytest.raises(openai.UnprocessableEntityError) as err:  # two images to a one-image model
            client.images.edit(model="tiny-flux-kontext", image=[_file(image, "a.png"), _file(image, "b.png")],
                               prompt="x")
        assert "expected 0 to 1 input image(s) for tiny-flux-kontext, got 2" in str(err.value)
        with pytest.raises(openai.NotFoundError):  # another model's name
            client.images.edit(model="gpt-image-2", image=_file(image, "a.png"), prompt="x")


def test_sdk_edit_with_several_images():
    refs = [seeded_image(2, 64, 64), seeded_image(3, 96, 64)]
    with sdk("tiny-flux2") as (client, worker):
        resp = client.images.edit(model="tiny-flux2", image=[_file(refs[0], "a.png"), _file(refs[1], "b.png")],
                                  prompt="make it snow", extra_body={"seed": 5, "num_inference_steps": 2})
        assert isinstance(resp, openai.types.ImagesResponse) and len(resp.data) == 1
        got = _pixels(resp.data[0])
        assert got.shape == (64, 64, 3)  # size auto: the first reference's
        assert_same_image(got, _direct(worker, "tiny-flux2", refs, 5, 2), "SDK multi-reference edit vs pipeline")
        one = client.images.edit(model="tiny-flux2", image=_file(refs[0], "a.png"), prompt="make it snow",
                                 extra_body={"seed": 5, "num_inference_steps": 2})
        assert np.abs(_pixels(one.data[0]).astype(int) - got.astype(int)).max() > 1  # the second image counts


def test_sdk_edit_with_a_mask():
    image = seeded_image(4, 96, 64)
    rgba = np.zeros((64, 96, 4), np.uint8)
    rgba[:, 48:, 3] = 0  # right half transparent: repaint there (OpenAI's mask)
    rgba[:, :48, 3] = 255
    with sdk("tiny-flux-fill") as (client, worker):
        resp = client.images.edit(model="tiny-flux-fill", image=_file(image, "in.png"),
                                  mask=_file(Image.fromarray(rgba, "RGBA"), "mask.png"), prompt="make it snow",
                                  extra_body={"seed": 8, "num_inference_steps": 2})
        white_right = Image.fromarray(np.where(np.arange(96)[None, :] >= 48, 255, 0).repeat(64, 0).astype(np.uint8),
                                      "L")
        want = _direct(worker, "tiny-flux-fill", [image], 8, 2, mask=white_right)
        assert_same_image(_pixels(resp.data[0]), want, "SDK masked edit vs pipeline")


# 50 requests with their 50 solo runs (32x32, one step): ~11 s on the 2-core CI machine
def test_50_concurrent_edits_each_equal_to_its_solo_run():
    """Adversarial: every request has its own image (seeded by its seed), some ask n=2, two sizes; batching
    "always" so the worker batches whatever it may. A batch mixing two requests' images would give one of them
    the other's edit: each answer must be byte for byte its request's alone."""
    requests = [dict(seed=i, n=1 + i % 2, size="32x32" if i % 3 else "48x32", image=seeded_image(1000 + i, 32, 32))
                for i in range(50)]

    def post(client: httpx.Client, r: dict) -> list[str]:
        files = {"image": _file(r["image"], f"{r['seed']}.png")}
        data = {"prompt": f"edit {r['seed']}", "seed": str(r["seed"]), "n": str(r["n"]), "size": r["size"],
                "num_inference_steps": "1"}
        answer = client.post("/v1/images/edits", files=files, data=data)
        assert answer.status_code == 200, answer.text
        return [d["b64_json"] for d in answer.json()["data"]]

    with one_torch_thread():
        worker = start_worker(ServerConfig(api_key=None, warmup=False, max_batch_size=4, batching="always",
                                           max_queue=64, batch_wait_s=0.05), "tiny-flux-kontext")
        try:
            with live_server(create_app(worker)) as url, httpx.Client(base_url=url, timeout=600) as client:
                together: dict[int, list[str]] = {}

                def run(r):
                    together[r["seed"]] = post(client, r)

                threads = [threading.Thread(target=run, args=(r,)) for r in requests]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                samples = {s.name: s.value for s in worker.metrics.batch_size.collect()[0].samples
                           if not s.name.endswith("_bucket")}
                solo = {r["seed"]: post(client, r) for r in requests}
        finally:
            worker.stop()
    assert len(together) == 50
    for r in requests:
        assert together[r["seed"]] == solo[r["seed"]], f"request {r['seed']} differs from its solo run"
    # 75 images in fewer pipeline calls: the n=2 requests' images (the same input) did share calls
    count = next(v for k, v in samples.items() if k.endswith("_count"))
    total = next(v for k, v in samples.items() if k.endswith("_sum"))
    assert total == 75 and count < total, samples
