"""The official OpenAI SDK's ``videos`` against the real server on tiny Wan 2.1 (world 1): ``create`` (multipart,
as the SDK sends it), ``retrieve``, ``list``, ``create_and_poll`` / ``poll``, ``download_content`` (the MP4, its
thumbnail, its spritesheet), ``delete``; and the cancel that comes too late (409 with the video's state).

Every answer is validated against the SDK's own ``Video`` type with one change: ``size`` as any string. The SDK
types it as Sora's four sizes (``VideoSize``), and the server answers the size it made (a tiny model makes
32x32); every other field is checked as the SDK declares it (`_checked`)."""

from __future__ import annotations

import base64
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from openai.types import Video, VideoDeleteResponse

from xstage_dit.runtime.generation import read_mp4, to_uint8
from xstage_dit.server.app import create_app
from xstage_dit.server.config import ServerConfig
from xstage_dit.server.media import mp4_bytes
from xstage_dit.server.videos.content import thumbnail
from tests.helpers.server import decode_png, live_server, one_torch_thread, start_worker, tiny

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


class _AnySizeVideo(Video):
    size: str  # the SDK's VideoSize lists Sora's sizes only


def _checked(video) -> Video:
    """`video` (what the SDK parsed) validated field by field as the SDK's Video (size: any string)."""
    assert isinstance(video, Video)
    _AnySizeVideo.model_validate(video.model_dump())
    return video


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def server():
    worker = start_worker(ServerConfig(max_batch_size=1, api_key=None), model="tiny-wan")
    with live_server(create_app(worker)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, worker, url
    worker.stop()


def _reference(seed: int, frames: int, steps: int) -> np.ndarray:
    pipe, served = tiny("tiny-wan")
    out = pipe("a cat walking", height=32, width=32, num_frames=frames, num_inference_steps=steps,
               guidance_scale=served.default_guidance, generator=torch.Generator("cpu").manual_seed(seed),
               output_type="np", **served.pipeline_kwargs)
    return to_uint8(np.asarray(out.frames[0]))


def test_create_poll_list_download_delete(server):
    client, worker, _ = server
    body = {"seed": 4, "num_inference_steps": 2}
    video = _checked(client.videos.create(prompt="a cat walking", size="32x32", seconds="0.25", extra_body=body))
    assert video.status in ("queued", "in_progress") and video.progress < 100 and video.completed_at is None
    # 0.25 s at 16 fps is 4 frames: the nearest k*4+1 is 5 (0.3125 s)
    assert (video.seconds, video.size, video.model, video.object) == ("0.3125", "32x32", "tiny-wan", "video")
    done = _checked(client.videos.poll(video.id, poll_interval_ms=50))
    assert done.status == "completed" and done.progress == 100 and done.completed_at >= done.created_at
    assert _checked(client.videos.retrieve(video.id)) == done
    listed = client.videos.list(limit=10)
    assert video.id in [_checked(v).id for v in listed.data] and listed.has_more is False
    mp4 = client.videos.download_content(video.id).content
    assert mp4 == mp4_bytes(_reference(4, 5, 2), 16)  # the pipeline's own frames, encoded as the server does
    thumb = client.videos.download_content(video.id, variant="thumbnail").content
    assert thumb == thumbnail(mp4) and thumb[:4] == b"\x89PNG"
    assert np.array_equal(decode_png(base64.b64encode(thumb).decode()), read_mp4(mp4)[0])  # the MP4's 1st frame
    sheet = client.videos.download_content(video.id, variant="spritesheet").content
    assert sheet[:3] == b"\xff\xd8\xff"
    deleted = client.videos.delete(video.id)
    assert isinstance(deleted, VideoDeleteResponse) and (deleted.id, deleted.deleted) == (video.id, True)
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)
    assert worker.queue.get(video.id) is None


def test_create_and_poll_and_pagination(server):
    client, _, _ = server
    ids = [_checked(client.videos.create_and_poll(prompt=f"clip {i}", size="32x32", seconds="0.25",
                                                  poll_interval_ms=50, extra_body={"num_inference_steps": 1})).id
           for i in range(3)]
    newest_first = [v.id for v in client.videos.list(limit=2, order="desc")]  # the SDK's pager follows last_id
    assert newest_first[:3] == ids[::-1]
    page = client.videos.list(limit=2, order="asc", after=ids[0])
    assert [v.id for v in page.data] == ids[1:] and page.last_id == ids[2]
    with pytest.raises(openai.NotFoundError) as info:
        client.videos.list(after="video_nope")
    assert info.value.body["param"] == "after"


def test_a_cancel_that_comes_too_late_answers_409_with_the_state(server, monkeypatch):
    """DELETE while the video decodes (its last step ran): the job completes, the answer is 409 with its state
    (completed) and nothing is deleted; a later DELETE deletes it."""
    client, worker, _ = server
    vae = worker.model.pipe.vae
    decoding, release = threading.Event(), threading.Event()
    real = vae.decode

    def slow_decode(*args, **kwargs):
        decoding.set()
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(vae, "decode", slow_decode)
    video = client.videos.create(prompt="late", size="32x32", seconds="0.25", extra_body={"num_inference_steps": 2})
    assert decoding.wait(60)  # its last step ran: the VAE decodes
    job = worker.queue.get(video.id)
    # The DELETE waits for the job to end; the decode goes on once the cancel has been asked for.
    releaser = threading.Thread(target=lambda: (_wait_for(lambda: job.cancel_requested), release.set()))
    releaser.start()
    with pytest.raises(openai.ConflictError) as info:
        client.videos.delete(video.id)
    releaser.join()
    assert info.value.body["param"] == "id" and "completed" in info.value.body["message"], info.value.body
    state = _checked(Video.model_construct(**info.value.response.json()["video"]))
    assert (state.id, state.status, state.progress) == (video.id, "completed", 100) and job.status == "completed"
    assert client.videos.retrieve(video.id).status == "completed"  # nothing was deleted
    assert client.videos.delete(video.id).deleted


def test_bad_video_requests_name_the_field(server):
    """Refused before anything is queued, each naming its field: a reference image for a text-to-video model (as a
    multipart file and as JSON), seconds and num_frames together, seconds that are no duration or too long, a body
    that is neither JSON nor a form, a file in a text field."""
    client, worker, url = server
    before = len(worker.queue.jobs())
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt="x", size="32x32", input_reference=("ref.png", b"\x89PNG...", "image/png"))
    assert info.value.body["param"] == "input_reference" and "takes none" in info.value.body["message"]
    cases = [
        ({"json": {"prompt": "x", "input_reference": "data:image/png;base64,AAAA"}}, 400, "input_reference"),
        ({"json": {"prompt": "x", "seconds": "1", "num_frames": 5}}, 422, "seconds"),
        ({"data": {"prompt": "x", "seconds": "four"}}, 422, "seconds"),
        ({"data": {"prompt": "x", "seconds": "0"}}, 422, "seconds"),
        ({"data": {"prompt": "x", "seconds": "60"}}, 422, "seconds"),
        ({"data": {"prompt": "x", "seconds": "1", "extra": "1"}}, 422, "extra"),
        ({"content": b"prompt=x", "headers": {"content-type": "text/plain"}}, 415, "content-type"),
        ({"data": {"prompt": "x"}, "files": {"prompt": ("p.txt", b"x", "text/plain")}}, 422, "prompt"),
        ({"data": {"prompt": ""}, "files": {"input_reference": ("r.png", b"x", "image/png")}}, 422, "prompt"),
    ]
    for kwargs, status, param in cases:
        r = httpx.post(f"{url}/v1/videos", timeout=60, **kwargs)
        assert r.status_code == status and r.json()["error"]["param"] == param, (kwargs, r.text)
        assert r.json()["error"]["message"].startswith(param), r.text
    assert len(worker.queue.jobs()) == before
    r = httpx.get(f"{url}/v1/videos", params={"limit": 0})
    assert r.status_code == 422 and r.json()["error"]["param"] == "limit", r.text


def test_content_of_a_video_not_completed_is_409(server):
    client, worker, _ = server
    video = client.videos.create(prompt="slow", size="256x256", seconds="1", extra_body={"num_inference_steps": 100})
    with pytest.raises(openai.ConflictError) as info:
        client.videos.download_content(video.id, variant="thumbnail")
    assert info.value.body["param"] == "id"
    assert client.videos.delete(video.id).deleted  # cancelled at its next step, then forgotten
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)


def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.time() + timeout_s
    while not predicate():
        assert time.time() < deadline
        time.sleep(0.01)
