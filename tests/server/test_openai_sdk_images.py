"""The official OpenAI SDK (openai 3.63, pinned in the test extra) against the real server on tiny FLUX (world 1):
``images.generate`` with every parameter of its signature, streamed and not, and ``models``; the client validates
every answer against the SDK's own types (``_strict_response_validation``: a field of the wrong type or a missing
one raises), and the images are diffusers' own output for their seed (the pipeline called directly).

Each parameter is either honoured (the answer shows it: steps, format, size, previews) or refused with a 4xx naming
it; `test_every_parameter_of_the_sdk_signature_is_covered` keeps the two tables equal to the SDK's signature."""

from __future__ import annotations

import base64
import inspect
import io
import time

import numpy as np
import openai
import pytest
from openai.types import ImageGenCompletedEvent, ImageGenPartialImageEvent, ImagesResponse, Model
from PIL import Image

from xstage_dit.runtime.generation import GenerationRequest, pipeline_kwargs, run_pipeline
from xstage_dit.server.app import create_app
from xstage_dit.server.config import ServerConfig
from xstage_dit.server.previews import decode_latents
from tests.helpers.server import (assert_same_image, live_server, one_torch_thread, reference_image, start_worker,
                                  tiny)

#: parameters honoured, each used (and checked) by a call below
HONOURED = {"prompt", "model", "n", "size", "quality", "output_format", "output_compression", "background",
            "moderation", "response_format", "stream", "partial_images", "user", "safety_identifier"}
#: parameters refused, with a value the SDK would send (each must answer 400 naming the parameter)
REFUSED = {"background": "transparent", "response_format": "url", "style": "vivid", "complexity": "high",
           "output_format": "gif", "frame_count": 4, "frame_duration_ms": 100, "svg": {"model": "x"}}
SDK_ONLY = {"extra_headers", "extra_query", "extra_body", "timeout"}


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def server():
    worker = start_worker(ServerConfig(max_batch_size=2, batch_wait_s=0.01, api_key=None, max_queue=8))
    with live_server(create_app(worker)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120,
                               _strict_response_validation=True)
        yield client, worker
    worker.stop()


@pytest.fixture(scope="module")
def reference():
    return tiny("tiny-flux")


def _pixels(b64: str) -> np.ndarray:
    return np.array(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def test_every_parameter_of_the_sdk_signature_is_covered():
    params = set(inspect.signature(openai.resources.images.Images.generate).parameters) - {"self"} - SDK_ONLY
    assert params == HONOURED | set(REFUSED), (params - HONOURED - set(REFUSED), HONOURED | set(REFUSED) - params)


def test_generate_honours_every_field_it_takes(server, reference):
    client, worker = server
    pipe, served = reference
    r = client.images.generate(prompt="a red cat", model="tiny-flux", n=2, size="32x48", quality="medium",
                               output_format="png", background="opaque", moderation="low", response_format="b64_json",
                               user="user-1", stream=False, partial_images=0, extra_body={"seed": 7})
    assert isinstance(r, ImagesResponse) and len(r.data) == 2
    assert (r.output_format, r.quality, r.size, r.background, r.safety_identifier) == ("png", "medium", "32x48",
                                                                                      "opaque", "user-1")
    assert r.usage.output_tokens == 2 * 2 * 3  # two images of (32/16) x (48/16) transformer tokens
    # quality medium: half the model's 4 steps; the images are the pipeline's own for their seeds
    for item, seed in zip(r.data, (7, 8)):
        assert_same_image(_pixels(item.b64_json), reference_image(pipe, served, "a red cat", seed, 32, 48, 2))
    # safety_identifier wins over user; quality low is a quarter of the steps; size auto is the model's own
    r = client.images.generate(prompt="a cat", size="auto", quality="low", user="u", safety_identifier="s",
                               extra_body={"seed": 3})
    assert (r.size, r.quality, r.safety_identifier) == ("128x128", "low", "s")
    assert_same_image(_pixels(r.data[0].b64_json), reference_image(pipe, served, "a cat", 3, 128, 128, 1))
    # num_inference_steps wins over quality (which the answer then does not claim)
    r = client.images.generate(prompt="a cat", size="32x32", quality="high", extra_body={"num_inference_steps": 1,
                                                                                          "seed": 3})
    assert r.quality is None
    assert_same_image(_pixels(r.data[0].b64_json), reference_image(pipe, served, "a cat", 3, 32, 32, 1))


@pytest.mark.parametrize("fmt, compression", [("jpeg", 40), ("webp", 90), ("jpeg", None)])
def test_output_format_and_compression(server, fmt, compression):
    """A JPEG / WebP answer is the PNG answer's pixels (the same seed) through Pillow at that quality (100 when
    output_compression is not given): the same bytes."""
    client, _ = server
    kwargs = {} if compression is None else {"output_compression": compression}
    body = {"seed": 5, "num_inference_steps": 2}
    r = client.images.generate(prompt="a red cat", size="32x32", output_format=fmt, extra_body=body, **kwargs)
    data = base64.b64decode(r.data[0].b64_json)
    assert r.output_format == fmt and Image.open(io.BytesIO(data)).format == fmt.upper()
    png = client.images.generate(prompt="a red cat", size="32x32", extra_body=body)
    out = io.BytesIO()
    Image.fromarray(_pixels(png.data[0].b64_json)).save(out, format=fmt.upper(),
                                                         quality=100 if compression is None else compression)
    assert data == out.getvalue()
    other = io.BytesIO()  # and the quality matters (the comparison above can fail)
    Image.fromarray(_pixels(png.data[0].b64_json)).save(other, format=fmt.upper(), quality=10)
    assert data != other.getvalue()


def _stream_reference(pipe, served, seed: int, steps: int, size: int) -> dict[int, np.ndarray]:
    """Step -> the pixels of the pipeline's latents after that step (its own decode), for the previews."""
    seen = {}

    def keep(p, index, timestep, kwargs):
        seen[index + 1] = kwargs["latents"].clone()
        return {}

    item = GenerationRequest(kind="image", prompt="a cat", width=size, height=size, steps=steps,
                             guidance=served.default_guidance, seed=seed)
    run_pipeline(pipe, **pipeline_kwargs(pipe, [item], kind="image", fixed=served.pipeline_kwargs),
                 callback_on_step_end=keep)
    return {step: decode_latents(pipe, latents, size, size)[0] for step, latents in seen.items()}


@pytest.mark.parametrize("partial", [0, 1, 3])
def test_streamed_events_are_the_sdks_types(server, reference, partial):
    client, _ = server
    pipe, served = reference
    stream = client.images.generate(prompt="a cat", size="32x32", stream=True, partial_images=partial,
                                     output_format="png", extra_body={"seed": 9, "num_inference_steps": 4})
    events = list(stream)
    assert all(isinstance(e, (ImageGenPartialImageEvent, ImageGenCompletedEvent)) and e.type and e.b64_json
               for e in events), [type(e).__name__ for e in events]
    partials, final = events[:-1], events[-1]
    assert [e.partial_image_index for e in partials] == list(range(partial))
    assert isinstance(final, ImageGenCompletedEvent) and final.size == "32x32" and final.usage.output_tokens == 4
    steps = _stream_reference(pipe, served, 9, 4, 32)
    assert_same_image(_pixels(final.b64_json), steps[4], "completed")
    # 1 preview: after step 2 of 4; 3 previews: after steps 1, 2, 3 (each the pipeline's latents decoded then)
    for event, step in zip(partials, {0: [], 1: [2], 3: [1, 2, 3]}[partial]):
        assert np.array_equal(_pixels(event.b64_json), steps[step]), f"preview {event.partial_image_index}"


def test_a_stream_with_every_honoured_parameter(server):
    """Streamed, every honoured parameter at once: two images, each one preview then its completed event."""
    client, _ = server
    events = list(client.images.generate(prompt="a cat", model="tiny-flux", n=2, size="32x32", quality="medium",
                                         output_format="webp", output_compression=80, background="opaque",
                                         moderation="auto", response_format="b64_json", stream=True,
                                         partial_images=1, user="u", safety_identifier="s", extra_body={"seed": 1}))
    kinds = [(e.type, e.image_index) for e in events]
    assert kinds == [("image_generation.partial_image", 0), ("image_generation.partial_image", 1),
                     ("image_generation.completed", 0), ("image_generation.completed", 1)], kinds
    assert [e.seed for e in events[2:]] == [1, 2] and [e.safety_identifier for e in events[2:]] == ["s", "s"]
    assert all((e.output_format, e.quality, e.background, e.size) == ("webp", "medium", "opaque", "32x32")
               for e in events)
    assert all(Image.open(io.BytesIO(base64.b64decode(e.b64_json))).format == "WEBP" for e in events)
    assert {e.timings["total_s"] > 0 for e in events[2:]} == {True}


@pytest.mark.parametrize("param, value", sorted(REFUSED.items()))
def test_each_refused_parameter_answers_400_naming_it(server, param, value):
    client, worker = server
    before = len(worker.queue.jobs())
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="a cat", size="32x32", **{param: value})
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == param and error["message"].startswith(param), error
    assert len(worker.queue.jobs()) == before  # nothing queued


@pytest.mark.parametrize("kwargs, param, status", [
    ({"output_format": "png", "output_compression": 50}, "output_compression", 400),
    ({"output_format": "jpeg", "output_compression": 101}, "output_compression", 422),
    ({"output_format": "svg"}, "output_format", 400),
    ({"partial_images": 4, "stream": True}, "partial_images", 422),
    ({"partial_images": 2}, "partial_images", 400),  # previews need a stream
    ({"quality": "ultra"}, "quality", 422),
    ({"moderation": "none"}, "moderation", 422),
    ({"size": "auto-ish"}, "size", 422),
    ({"n": 0}, "n", 422),
    ({"model": "gpt-image-2"}, "model", 404),
    ({"output_format": "jpeg", "extra_body": {"response_format": "png"}}, "response_format", 400),
])
def test_bad_values_name_the_field(server, kwargs, param, status):
    client, worker = server
    before = len(worker.queue.jobs())
    with pytest.raises(openai.APIStatusError) as info:
        client.images.generate(prompt="a cat", size=kwargs.pop("size", "32x32"), **kwargs)
    assert info.value.status_code == status and info.value.body["param"] == param, info.value.body
    assert len(worker.queue.jobs()) == before


def test_models_list_and_retrieve(server):
    client, _ = server
    listed = client.models.list()
    assert [m.id for m in listed.data] == ["tiny-flux"] and all(isinstance(m, Model) for m in listed.data)
    model = client.models.retrieve("tiny-flux")
    assert isinstance(model, Model) and model.id == "tiny-flux" and model.created > 0 and model.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-image-2")
    assert info.value.body["param"] == "model" and "tiny-flux" in info.value.body["message"]


def test_a_failed_stream_raises_in_the_sdk(server):
    """A job that ends without its image (here: cancelled while it streams) ends the stream with an `error` event,
    which the SDK raises as an APIError."""
    client, worker = server
    stream = client.images.generate(prompt="slow", size="512x512", stream=True,
                                    extra_body={"num_inference_steps": 100})
    job = worker.queue.get(stream.response.headers["x-job-id"])
    deadline = time.time() + 60
    while job.steps_done < 1:
        assert time.time() < deadline, "the slow job did not start"
        time.sleep(0.05)
    worker.queue.cancel(job.id)
    with pytest.raises(openai.APIError, match="cancelled"):
        list(stream)
    assert job.status == "cancelled" and job.steps_done < 100
