"""`POST /v1/images/edits` and ``input_reference`` of `POST /v1/videos` against the real app and tiny pipelines: the
edit is the pipeline's own output for the uploaded image (multipart and JSON alike), a mask and several images
reach the pipelines that take them, and every bad input is a 4xx naming its field with nothing queued."""

from __future__ import annotations

import base64
import io
import struct
import time
import zlib

import httpx
import numpy as np
import pytest
from PIL import Image

from xstage_dit.server.app import create_app
from xstage_dit.server.config import ServerConfig
from tests.helpers.family_harness import seeded_image
from tests.helpers.server import assert_same_image, decode_png, live_server, one_torch_thread, start_worker

CONFIG = dict(api_key=None, warmup=False, max_batch_size=1)


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def claimed_size_png(width: int, height: int) -> bytes:
    """A small PNG whose header claims width x height (its CRC fixed): a decoder that trusted it would allocate
    width x height pixels; its data is a 1x1 image, so decoding it could only fail."""
    data = bytearray(png_bytes(Image.new("L", (1, 1))))
    ihdr = 8  # after the signature: length (4), b"IHDR", width, height, ...
    data[ihdr + 8:ihdr + 16] = struct.pack(">II", width, height)
    data[ihdr + 21:ihdr + 25] = struct.pack(">I", zlib.crc32(bytes(data[ihdr + 4:ihdr + 21])))
    return bytes(data)


@pytest.fixture(scope="module")
def servers():
    """model -> (client, worker): one live server per tiny model the tests edit with."""
    import contextlib

    with contextlib.ExitStack() as stack, one_torch_thread():
        out = {}
        for model, extra in (("tiny-flux-kontext", {}), ("tiny-flux-fill", {}), ("tiny-flux", {}),
                             ("tiny-wan-i2v", {}), ("tiny-wan", {}), ("tiny-wan-flf2v", {}),
                             ("tiny-hunyuanvideo15-i2v", {}),
                             ("tiny-flux-img2img", dict(max_image_pixels=96 * 64, max_upload_bytes=32 * 1024))):
            worker = start_worker(ServerConfig(**CONFIG, **extra), model)
            stack.callback(worker.stop)
            url = stack.enter_context(live_server(create_app(worker)))
            out[model] = (stack.enter_context(httpx.Client(base_url=url, timeout=300)), worker)
        yield out


def _direct(worker, model: str, image, seed: int, steps: int, mask=None, **size) -> np.ndarray:
    """The served pipeline called with the product's arguments for this image (or list of images): uint8 pixels of
    output 0."""
    from xstage_dit.families import model_spec
    from xstage_dit.runtime.generation import fixed_kwargs, output_pixels, pipeline_kwargs, request_for

    spec = model_spec(model)
    images = image if isinstance(image, list) else [image]
    request = request_for(spec, prompt="make it snow", seed=seed, steps=steps, images=images, mask=mask, **size)
    pipe = worker.model.pipe
    return output_pixels(pipe(**pipeline_kwargs(pipe, [request], kind=spec.kind, fixed=fixed_kwargs(spec))),
                         spec.kind)[0]


def test_an_edit_is_the_pipelines_output_multipart_and_json_alike(servers):
    client, worker = servers["tiny-flux-kontext"]
    image = seeded_image(1, 96, 64)
    form = client.post("/v1/images/edits", files={"image": ("in.png", png_bytes(image), "image/png")},
                       data={"prompt": "make it snow", "seed": "4", "num_inference_steps": "2", "n": "2"})
    assert form.status_code == 200, form.text
    body = form.json()
    assert [d["seed"] for d in body["data"]] == [4, 5]
    pixels = decode_png(body["data"][0]["b64_json"])
    assert pixels.shape == (64, 96, 3)  # size auto: the image's
    with one_torch_thread():
        assert_same_image(pixels, _direct(worker, "tiny-flux-kontext", image, 4, 2), "served vs pipeline")
        other = _direct(worker, "tiny-flux-kontext", seeded_image(2, 96, 64), 4, 2)
    assert np.abs(other.astype(int) - pixels.astype(int)).max() > 1  # another image, another edit
    as_json = client.post("/v1/images/edits", json={"prompt": "make it snow", "seed": 4, "num_inference_steps": 2,
                                                    "image": "data:image/png;base64," + base64.b64encode(
                                                        png_bytes(image)).decode()})
    assert as_json.status_code == 200 and as_json.json()["data"][0]["b64_json"] == body["data"][0]["b64_json"]
    sized = client.post("/v1/images/edits", files={"image": ("in.png", png_bytes(image), "image/png")},
                        data={"prompt": "make it snow", "size": "48x32", "num_inference_steps": "1"})
    assert decode_png(sized.json()["data"][0]["b64_json"]).shape == (32, 48, 3)


def test_a_mask_reaches_the_inpainting_pipeline(servers):
    client, worker = servers["tiny-flux-fill"]
    image, mask = seeded_image(3, 96, 64), seeded_image(4, 96, 64, "L")
    r = client.post("/v1/images/edits", files={"image": ("in.png", png_bytes(image), "image/png"),
                                               "mask": ("mask.png", png_bytes(mask), "image/png")},
                    data={"prompt": "make it snow", "seed": "2", "num_inference_steps": "2"})
    assert r.status_code == 200, r.text
    with one_torch_thread():
        want = _direct(worker, "tiny-flux-fill", image, 2, 2, mask=mask)
    assert_same_image(decode_png(r.json()["data"][0]["b64_json"]), want, "served vs pipeline")
    # OpenAI's mask: transparent = edit there; the same mask as alpha gives the same image
    alpha = Image.fromarray(np.dstack([np.zeros((64, 96, 3), np.uint8), 255 - np.asarray(mask)]), "RGBA")
    r2 = client.post("/v1/images/edits", files={"image": ("in.png", png_bytes(image), "image/png"),
                                                "mask": ("mask.png", png_bytes(alpha), "image/png")},
                     data={"prompt": "make it snow", "seed": "2", "num_inference_steps": "2"})
    assert r2.json()["data"][0]["b64_json"] == r.json()["data"][0]["b64_json"]


def test_image_to_video_takes_its_first_frame_as_input_reference(servers):
    from xstage_dit.runtime.generation import read_mp4
    from xstage_dit.runtime.mp4 import encode_mp4

    client, worker = servers["tiny-wan-i2v"]
    image = seeded_image(5, 80, 60)
    r = client.post("/v1/videos", json={"prompt": "make it snow", "seed": 6, "num_inference_steps": 2,
                                        "num_frames": 5, "size": "64x48",
                                        "input_reference": base64.b64encode(png_bytes(image)).decode()})
    assert r.status_code == 202, r.text
    video_id = r.json()["id"]
    deadline = time.monotonic() + 300
    while client.get(f"/v1/videos/{video_id}").json()["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    mp4 = client.get(f"/v1/videos/{video_id}/content")
    assert mp4.status_code == 200
    with one_torch_thread():
        want = _direct(worker, "tiny-wan-i2v", image, 6, 2, width=64, height=48, frames=5)
    assert read_mp4(mp4.content).shape == (5, 48, 64, 3)
    assert mp4.content == encode_mp4(want, 16)  # the pipeline's frames through the one encoder


def _finished_mp4(client, video_id: str) -> bytes:
    deadline = time.monotonic() + 300
    while client.get(f"/v1/videos/{video_id}").json()["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    mp4 = client.get(f"/v1/videos/{video_id}/content")
    assert mp4.status_code == 200, mp4.text
    return mp4.content


def test_first_last_frame_takes_two_references_multipart_and_json_alike(servers):
    """Wan FLF2V: ``input_reference`` twice in a form (the SDK's multipart shape) or a JSON list: the first and
    the last frame, in order; the pipeline's own video for them (and another last frame, another video)."""
    from xstage_dit.runtime.mp4 import encode_mp4

    client, worker = servers["tiny-wan-flf2v"]
    first, last = seeded_image(5, 80, 60), seeded_image(6, 64, 48)
    fields = {"prompt": "make it snow", "seed": "6", "num_inference_steps": "2", "num_frames": "5", "size": "64x48"}
    form = client.post("/v1/videos", data=fields, files=[("input_reference", ("a.png", png_bytes(first), "image/png")),
                                                         ("input_reference", ("b.png", png_bytes(last), "image/png"))])
    assert form.status_code == 202, form.text
    as_json = client.post("/v1/videos", json={**fields, "seed": 6, "num_inference_steps": 2, "num_frames": 5,
                                              "input_reference": [base64.b64encode(png_bytes(i)).decode()
                                                                  for i in (first, last)]})
    assert as_json.status_code == 202, as_json.text
    mp4 = _finished_mp4(client, form.json()["id"])
    assert _finished_mp4(client, as_json.json()["id"]) == mp4
    with one_torch_thread():
        want = _direct(worker, "tiny-wan-flf2v", [first, last], 6, 2, width=64, height=48, frames=5)
        other = _direct(worker, "tiny-wan-flf2v", [first, seeded_image(7, 64, 48)], 6, 2, width=64, height=48,
                        frames=5)
    assert mp4 == encode_mp4(want, 16)
    assert np.abs(other.astype(int) - want.astype(int)).max() > 1  # the last frame reaches the pipeline
    card = client.get("/v1/models/tiny-wan-flf2v").json()["input_images"]
    assert (card["min_images"], card["max_images"]) == (2, 2)


def test_a_pipeline_that_sizes_the_video_from_the_image_reports_that_size(servers):
    """HunyuanVideo 1.5 I2V takes no size: a request without one gets the bucket its pipeline makes of the image
    (a 5:3 image: 80x48), reported in the video object and made; another explicit size is a 422 naming it."""
    from xstage_dit.runtime.generation import read_mp4
    from xstage_dit.runtime.mp4 import encode_mp4

    client, worker = servers["tiny-hunyuanvideo15-i2v"]
    image = seeded_image(8, 100, 60)
    reference = base64.b64encode(png_bytes(image)).decode()
    r = client.post("/v1/videos", json={"prompt": "make it snow", "seed": 3, "num_inference_steps": 2,
                                        "num_frames": 5, "input_reference": reference})
    assert r.status_code == 202 and r.json()["size"] == "80x48", r.text
    mp4 = _finished_mp4(client, r.json()["id"])
    with one_torch_thread():
        want = _direct(worker, "tiny-hunyuanvideo15-i2v", image, 3, 2, frames=5)
    assert read_mp4(mp4).shape == (5, 48, 80, 3) and mp4 == encode_mp4(want, 24)
    before = len(list(worker.queue.jobs()))
    bad = client.post("/v1/videos", json={"prompt": "x", "num_frames": 5, "size": "64x64",
                                          "input_reference": reference})
    assert (bad.status_code, bad.json()["error"]["param"]) == (422, "size"), bad.text
    assert "expected no size or '80x48'" in bad.json()["error"]["message"]
    assert len(list(worker.queue.jobs())) == before


def _edit(client, *, image=None, mask=None, fields=None, files=None, **kw):
    files = list(files or [])
    if image is not None:
        files.append(("image", ("in.png", image, "image/png")))
    if mask is not None:
        files.append(("mask", ("mask.png", mask, "image/png")))
    return client.post("/v1/images/edits", files=files or None, data={"prompt": "x", **(fields or {})}, **kw)


GOOD = png_bytes(seeded_image(1, 96, 64))
BAD_EDITS = {
    # name: (model, request kwargs, status, param, message part)
    "not-an-image": ("tiny-flux-kontext", dict(image=b"GIF89a? no"), 400, "image", "expected a PNG, JPEG or WebP"),
    "gif": ("tiny-flux-kontext", dict(image=b"GIF89a\x01\x00\x01\x00\x00\x00\x00;"), 400, "image",
            "expected a PNG, JPEG or WebP image"),
    "truncated": ("tiny-flux-kontext", dict(image=GOOD[:len(GOOD) // 2]), 400, "image", "truncated or corrupt"),
    "empty": ("tiny-flux-kontext", dict(image=b""), 400, "image", "got an empty file"),
    # a header claiming 4.5 GB of pixels (Pillow itself refuses past 2x its MAX_IMAGE_PIXELS) and one under that
    "bomb": ("tiny-flux-kontext", dict(image=claimed_size_png(50_000, 50_000)), 422, "image",
             "expected at most 16777216 pixels (--max-image-pixels), got 2500000000 (refused before decoding)"),
    "bomb-under-pillows-limit": ("tiny-flux-kontext", dict(image=claimed_size_png(8_000, 8_000)), 422, "image",
                                 "expected at most 16777216 pixels (--max-image-pixels), got 8000x8000 (refused "
                                 "before decoding)"),
    "over-the-flag": ("tiny-flux-img2img", dict(image=png_bytes(seeded_image(1, 112, 64))), 422, "image",
                      "expected at most 6144 pixels (--max-image-pixels), got 112x64"),
    "too-many": ("tiny-flux-kontext", dict(files=[("image[]", ("a.png", GOOD, "image/png"))] * 2), 422, "image",
                 "expected 0 to 1 input image(s) for tiny-flux-kontext, got 2"),
    "over-16": ("tiny-flux-kontext", dict(files=[("image[]", ("a.png", GOOD, "image/png"))] * 17), 422, "image",
                "expected 1 to 16 images, got 17"),
    "no-image": ("tiny-flux-kontext", dict(), 422, "image", "field required"),
    "mask-size": ("tiny-flux-fill", dict(image=GOOD, mask=png_bytes(seeded_image(1, 64, 64, "L"))), 422, "mask",
                  "expected the image's size 96x64, got 64x64"),
    "mask-not-taken": ("tiny-flux-kontext", dict(image=GOOD, mask=GOOD), 422, "mask", "expected no mask"),
    "takes-no-image": ("tiny-flux", dict(image=GOOD), 400, "image",
                       "expected no input image for tiny-flux (its pipeline takes none), got 1"),
    "video-model": ("tiny-wan-i2v", dict(image=GOOD), 400, "model", "use POST /v1/videos with input_reference"),
    "bad-base64": ("tiny-flux-kontext", dict(json={"prompt": "x", "image": "not base64!"}), 400, "image",
                   "expected base64 image data"),
    "url": ("tiny-flux-kontext", dict(json={"prompt": "x", "image": "https://example.com/a.png"}), 400, "image",
            "this server downloads nothing"),
    "unknown-field": ("tiny-flux-kontext", dict(image=GOOD, fields={"colour": "red"}), 422, "colour",
                      "unknown field"),
    "markup": ("tiny-flux-kontext", dict(image=GOOD, files=[("markup", ("m.png", GOOD, "image/png"))]), 400,
               "markup", "no markup overlay"),
    "fidelity": ("tiny-flux-kontext", dict(image=GOOD, fields={"input_fidelity": "high"}), 400, "input_fidelity",
                 "no fidelity control"),
    "bad-size": ("tiny-flux-kontext", dict(image=GOOD, fields={"size": "100x64"}), 422, "size", "a multiple of 16"),
    "too-small": ("tiny-flux-kontext", dict(image=png_bytes(seeded_image(1, 8, 8))), 422, "image",
                  "expected images of at least 16x16 pixels for tiny-flux-kontext, got 8x8"),
    "auto-too-wide": ("tiny-flux-kontext", dict(image=png_bytes(seeded_image(1, 2064, 16))), 422, "size",
                      "expected width in [16, 2048], got 2064 (size auto: the input image's 2064x16); pass a size"),
    "media-type": ("tiny-flux-kontext", dict(content=b"x", headers={"content-type": "text/plain"}), 415,
                   "content-type", "expected application/json or multipart/form-data, got 'text/plain'"),
    "body-limit": ("tiny-flux-img2img", dict(image=png_bytes(seeded_image(1, 96, 64)) + b"\0" * 40_000), 413, "body",
                   "expected at most 32768 bytes"),
}


@pytest.mark.parametrize("name", sorted(BAD_EDITS))
def test_bad_inputs_are_named_and_nothing_is_queued(servers, name):
    model, kwargs, status, param, needle = BAD_EDITS[name]
    client, worker = servers[model]
    before = len(list(worker.queue.jobs()))
    if "json" in kwargs or "content" in kwargs:
        r = client.post("/v1/images/edits", **kwargs)
    else:
        r = _edit(client, **kwargs)
    error = r.json()["error"]
    assert (r.status_code, error["param"]) == (status, param), r.text
    assert needle in error["message"], error["message"]
    assert len(list(worker.queue.jobs())) == before  # refused before anything was queued


BAD_VIDEOS = {
    "t2v-given-one": ("tiny-wan", {"input_reference": base64.b64encode(GOOD).decode()}, 400,
                      "expected no input image for tiny-wan (its pipeline takes none), got 1"),
    "i2v-without": ("tiny-wan-i2v", {}, 422, "expected 1 input image(s) for tiny-wan-i2v, got 0"),
    "bad-base64": ("tiny-wan-i2v", {"input_reference": "%%"}, 400, "expected base64 image data"),
    "file-id": ("tiny-wan-i2v", {"input_reference": {"file_id": "file_1"}}, 400, "keeps no file store"),
    "truncated": ("tiny-wan-i2v", {"input_reference": base64.b64encode(GOOD[:100]).decode()}, 400,
                  "truncated or corrupt"),
    "i2v-given-two": ("tiny-wan-i2v", {"input_reference": [base64.b64encode(GOOD).decode()] * 2}, 422,
                      "expected 1 input image(s) for tiny-wan-i2v, got 2"),
    "flf2v-given-one": ("tiny-wan-flf2v", {"input_reference": base64.b64encode(GOOD).decode()}, 422,
                        "expected 2 input image(s) for tiny-wan-flf2v, got 1"),
    "t2v-given-two": ("tiny-wan", {"input_reference": [base64.b64encode(GOOD).decode()] * 2}, 400,
                      "expected no input image for tiny-wan (its pipeline takes none), got 2"),
}


@pytest.mark.parametrize("name", sorted(BAD_VIDEOS))
def test_bad_video_references_are_named_and_nothing_is_queued(servers, name):
    model, fields, status, needle = BAD_VIDEOS[name]
    client, worker = servers[model]
    before = len(list(worker.queue.jobs()))
    r = client.post("/v1/videos", json={"prompt": "x", "num_frames": 5, "size": "64x48", **fields})
    error = r.json()["error"]
    assert (r.status_code, error["param"]) == (status, "input_reference"), r.text
    assert needle in error["message"], error["message"]
    assert len(list(worker.queue.jobs())) == before


def test_a_model_that_needs_an_image_points_text_requests_at_edits(servers):
    client, _ = servers["tiny-flux-img2img"]
    r = client.post("/v1/images/generations", json={"prompt": "x"})
    assert r.status_code == 400 and "use POST /v1/images/edits" in r.json()["error"]["message"]
    kontext, _ = servers["tiny-flux-kontext"]  # Kontext also generates from text alone
    assert kontext.post("/v1/images/generations", json={"prompt": "x", "size": "32x32",
                                                        "num_inference_steps": 1}).status_code == 200


def test_warm_up_edits_synthetic_images_and_measures_batching():
    """A model that needs an input image warms up on a synthetic one (text alone would fail) and its batch probe
    runs on it: the size's batching decision is recorded."""
    with one_torch_thread():
        worker = start_worker(ServerConfig(api_key=None, warmup=True, max_batch_size=2, batching="auto"),
                              "tiny-flux-img2img")
        try:
            assert worker.state == "ready"
            sizes = worker.batcher.report()["sizes"]
            assert set(sizes) == {"128x128"} and sizes["128x128"]["speedup"] is not None, sizes
        finally:
            worker.stop()


@pytest.mark.slow  # two ranks started by `xstage-dit serve --sp 2`: ~40 s on the 2-core CI machine
def test_an_edit_served_on_two_ranks_is_the_one_process_edit(servers):
    from tests.helpers.server import multirank_server

    image = seeded_image(7, 96, 64)
    fields = {"prompt": "make it snow", "seed": "9", "num_inference_steps": "2"}
    files = {"image": ("in.png", png_bytes(image), "image/png")}
    one = servers["tiny-flux-kontext"][0].post("/v1/images/edits", files=files, data=fields)
    with multirank_server("--no-warmup", "--max-batch-size", "1", model="tiny-flux-kontext", log_name="serve-edit",
                          client_timeout_s=300) as (client, _, _):
        two = client.post("/v1/images/edits", files=files, data=fields)
    assert one.status_code == two.status_code == 200, two.text
    assert_same_image(decode_png(two.json()["data"][0]["b64_json"]), decode_png(one.json()["data"][0]["b64_json"]),
                      "sp=2 vs one process")
