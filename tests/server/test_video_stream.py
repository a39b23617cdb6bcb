"""The MP4 encoded while the VAE decodes (`xstage_dit.server.video_stream`), on the real tiny Wan pipeline:
the streamed MP4 is byte for byte the one encoded from the output after the call, the encoder is fed during the
call (one chunk per latent frame), a stream that is not the output is refused (the output is encoded instead),
and a stopped call leaves no encoder or file behind."""

from __future__ import annotations

import logging
import os
import tempfile
import threading

import pytest
import torch

from xstage_dit.runtime.generation import GenerationRequest
from xstage_dit.server import media, video_stream
from xstage_dit.server.runner import BatchRunner, BatchStopped
from tests.helpers.server import one_torch_thread, tiny


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def wan():
    pipe, served = tiny("tiny-wan")
    return pipe, served, BatchRunner(pipe, served)


def _item(served, seed=3, frames=9, steps=2, fps=8):
    return GenerationRequest(kind="video", prompt="a cat walking", width=32, height=32, steps=steps,
                             guidance=served.default_guidance, seed=seed, num_frames=frames, fps=fps)


def _stream_threads() -> int:
    return sum(t.name == "xstage-video-stream" for t in threading.enumerate())


def test_tiny_wan_streams(wan):
    pipe, _, _ = wan
    assert video_stream.streams(pipe)
    pipe.vae.enable_tiling()
    try:
        assert not video_stream.streams(pipe)  # a tile is part of a frame
    finally:
        pipe.vae.disable_tiling()
    flux, _ = tiny("tiny-flux")
    assert not video_stream.streams(flux)


def test_the_streamed_mp4_is_the_output_encoded_after_the_call(wan):
    pipe, served, runner = wan
    chunks = []
    probe = pipe.vae.decoder.register_forward_hook(lambda m, a, out: chunks.append(out.shape[2]))
    try:
        result = runner.run([_item(served)], lambda *a: True, stream_video=True)
    finally:
        probe.remove()
    assert result.video_stream is not None
    assert chunks == [1, 4, 4]  # 9 frames: one chunk per latent frame, each handed to the encoder as decoded
    streamed = result.video_stream.finish(result.pixels[0])
    assert streamed == media.mp4_bytes(result.pixels[0], 8)
    assert not pipe.vae.decoder._forward_hooks  # the stream's hook is off after the call
    # Without asking, or for an image, nothing streams.
    assert runner.run([_item(served)], lambda *a: True).video_stream is None


def test_a_stream_that_is_not_the_output_is_refused(wan, caplog):
    _, served, runner = wan
    result = runner.run([_item(served, seed=4)], lambda *a: True, stream_video=True)
    other = result.pixels[0].copy()
    other[5, 0, 0, 0] ^= 1
    with caplog.at_level(logging.WARNING, logger="xstage_dit.server.video_stream"):
        assert result.video_stream.finish(other) is None
    assert "frames 5-8 differ" in caplog.text
    result = runner.run([_item(served, seed=4)], lambda *a: True, stream_video=True)
    with caplog.at_level(logging.WARNING, logger="xstage_dit.server.video_stream"):
        assert result.video_stream.finish(result.pixels[0][:5]) is None
    assert "expected the streamed frames to be the output's (5, 32, 32, 3), got 9 frames" in caplog.text


def test_a_stopped_call_leaves_no_encoder_or_file(wan, tmp_path, monkeypatch):
    pipe, served, runner = wan
    # The encoder's file goes where tempfile puts it: a folder of this test's own, so an .mp4 another test worker
    # writes to the shared temp folder meanwhile is not counted as ours (CI, 2026-12-07, two workers)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = set(os.listdir(tempfile.gettempdir()))
    with pytest.raises(BatchStopped):
        runner.run([_item(served, steps=3)], lambda done, *a: done < 2, stream_video=True)
    assert _stream_threads() == 0
    assert not pipe.vae.decoder._forward_hooks
    assert {p for p in set(os.listdir(tempfile.gettempdir())) - before if p.endswith(".mp4")} == set()
    # A result nobody delivers is discarded: its encoder stops, its file goes.
    result = runner.run([_item(served)], lambda *a: True, stream_video=True)
    result.discard()
    result.discard()
    assert result.video_stream is None and _stream_threads() == 0
    assert {p for p in set(os.listdir(tempfile.gettempdir())) - before if p.endswith(".mp4")} == set()


def test_a_failing_pipeline_stops_the_stream(wan):
    pipe, served, runner = wan

    def fail(module, args, output):
        raise RuntimeError("decoder out of memory")

    hook = pipe.vae.decoder.register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            runner.run([_item(served)], lambda *a: True, stream_video=True)
    finally:
        hook.remove()
    assert _stream_threads() == 0 and not pipe.vae.decoder._forward_hooks


def test_a_chunk_is_post_processed_as_the_pipeline_would():
    """A decoder chunk in [-1, 1] past its ends: the VAE's clamp, the processor's [0, 1], the one rounding rule."""
    processor = tiny("tiny-wan")[0].video_processor

    class Pipe:
        video_processor = processor
        vae = type("Vae", (), {"decoder": torch.nn.Identity()})()

    stream = video_stream.StreamedVideo(Pipe(), 8)
    chunk = torch.rand(1, 3, 4, 16, 16) * 2.4 - 1.2  # past [-1, 1]: the clamp matters
    Pipe.vae.decoder(chunk)
    want = ((chunk.clamp(-1, 1) * 0.5 + 0.5).clamp(0, 1).mul(255).add(0.5).to(torch.uint8))
    data = stream.finish(want[0].permute(1, 2, 3, 0).numpy())
    assert data is not None and data == media.mp4_bytes(want[0].permute(1, 2, 3, 0).numpy(), 8)


@pytest.mark.parametrize("policy,streamed", [("always", [True]), ("gpu", []), ("never", [])])
def test_the_server_answers_with_the_streamed_mp4_where_its_policy_says(monkeypatch, policy, streamed):
    """"gpu" (the default) streams only where the pipeline runs on a GPU: this CPU run encodes after the call."""
    import httpx

    from xstage_dit.server.app import create_app
    from xstage_dit.server.config import ServerConfig
    from tests.helpers.server import live_server, start_worker

    finished = []
    real_finish = video_stream.StreamedVideo.finish

    def finish(self, pixels):
        data = real_finish(self, pixels)
        finished.append(data is not None)
        return data

    monkeypatch.setattr(video_stream.StreamedVideo, "finish", finish)
    worker = start_worker(ServerConfig(api_key=None, video_stream=policy), model="tiny-wan")
    try:
        with live_server(create_app(worker)) as url, httpx.Client(base_url=url, timeout=60) as client:
            job = client.post("/v1/videos", json={"prompt": "a cat", "size": "32x32", "num_frames": 9,
                                                  "num_inference_steps": 2, "seed": 1, "fps": 8}).json()
            for _ in range(600):
                if client.get(f"/v1/videos/{job['id']}").json()["status"] == "completed":
                    break
                threading.Event().wait(0.05)
            content = client.get(f"/v1/videos/{job['id']}/content")
    finally:
        worker.stop()
    assert content.status_code == 200 and content.content[4:8] == b"ftyp"
    assert finished == streamed  # warm-up streams nothing; with "always" the request's MP4 came from the stream


def test_video_stream_policy_is_checked():
    from xstage_dit.server.config import ServerConfig

    with pytest.raises(ValueError, match="video_stream: expected gpu, always or never, got 'sometimes'"):
        ServerConfig(video_stream="sometimes")
