"""Video jobs against the real tiny Wan 2.1 pipeline: POST /v1/videos -> id; progress by SSE and by
polling; the MP4 content decodes to the frames the pipeline produces for that seed; DELETE cancels a
running job at its next step; validation names the field."""

from __future__ import annotations

import json
import time

import httpx
import numpy as np
import pytest
import torch

from xstage_dit.runtime.generation import read_mp4, to_uint8
from xstage_dit.server.app import create_app
from xstage_dit.server.config import ServerConfig
from xstage_dit.server.media import mp4_bytes
from tests.helpers.server import live_server, one_torch_thread, start_worker, tiny


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    with one_torch_thread():
        yield


def _has_tiny_wan() -> bool:
    from xstage_dit.families import model_names

    return "tiny-wan" in model_names()


pytestmark = pytest.mark.skipif(not _has_tiny_wan(), reason="tiny-wan is not in the model registry yet")


@pytest.fixture(scope="module")
def server():
    worker = start_worker(ServerConfig(max_batch_size=2, api_key=None), model="tiny-wan")
    with live_server(create_app(worker)) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client, worker
    worker.stop()


def reference_frames(seed: int, prompt: str, size: int, frames: int, steps: int) -> np.ndarray:
    pipe, served = tiny("tiny-wan")
    out = pipe(prompt, height=size, width=size, num_frames=frames, num_inference_steps=steps,
               guidance_scale=served.default_guidance, generator=torch.Generator("cpu").manual_seed(seed),
               output_type="np", **served.pipeline_kwargs)
    return to_uint8(np.asarray(out.frames[0]))


def test_video_job_progress_and_mp4_content(server):
    client, _ = server
    r = client.post("/v1/videos", json={"prompt": "a cat walking", "size": "32x32", "num_frames": 5,
                                        "num_inference_steps": 3, "seed": 4, "fps": 8})
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["object"] == "video" and job["status"] in ("queued", "in_progress") and job["num_frames"] == 5
    with client.stream("GET", f"/v1/videos/{job['id']}/events") as r:
        events, name = [], None
        for line in r.iter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                events.append((name, json.loads(line[5:])))
    steps = [e["steps_done"] for n, e in events if n == "progress"]
    assert events[-1][0] == "completed" and events[-1][1]["id"] == job["id"]
    assert steps == sorted(steps) and steps[-1] == 3 and len(set(steps)) >= 3
    status = client.get(f"/v1/videos/{job['id']}").json()
    assert status["status"] == "completed" and status["completed_at"] >= status["created_at"]
    assert (status["progress"], status["steps_done"], status["steps_total"]) == (100, 3, 3)
    assert status["seconds"] == "0.625" and status["error"] is None  # 5 frames at 8 fps
    assert status["timings"]["run_s"] > 0
    content = client.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    frames = read_mp4(content.content)
    assert frames.shape == (5, 32, 32, 3)
    want, other = reference_frames(4, "a cat walking", 32, 5, 3), reference_frames(5, "a cat walking", 32, 5, 3)
    err_want = np.abs(frames.astype(float) - want).mean()
    err_other = np.abs(frames.astype(float) - other).mean()
    # H.264 is lossy: the video is near its seed's frames and clearly farther from another seed's.
    assert err_want < 12 and err_want < err_other / 2, (err_want, err_other)
    # And it is exactly the MP4 of those frames (the server encodes while the VAE decodes: `video_stream`).
    assert content.content == mp4_bytes(want, 8)


def test_cancel_running_video_and_errors(server):
    client, worker = server
    r = client.post("/v1/videos", json={"prompt": "long", "size": "256x256", "num_frames": 17,
                                        "num_inference_steps": 100})
    video_id = r.json()["id"]
    deadline = time.time() + 60
    while client.get(f"/v1/videos/{video_id}").json()["steps_done"] < 1:
        assert time.time() < deadline
        time.sleep(0.05)
    job = worker.queue.get(video_id)
    # DELETE cancels a running video (answering once it stopped) and then forgets it
    deleted = client.delete(f"/v1/videos/{video_id}")
    assert deleted.status_code == 200 and deleted.json() == {"id": video_id, "object": "video.deleted", "deleted": True}
    assert job.status == "cancelled" and job.steps_done < 100
    assert client.get(f"/v1/videos/{video_id}").status_code == 404
    assert client.get(f"/v1/videos/{video_id}/content").status_code == 404
    assert client.get("/v1/videos/video_nope").status_code == 404
    bad = client.post("/v1/videos", json={"prompt": "x", "num_frames": 6})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "num_frames"
    wrong = client.post("/v1/images/generations", json={"prompt": "x"})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "model"
