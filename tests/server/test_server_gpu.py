"""The server on a GPU (run by scripts/gpu_tests.sh): tiny FLUX in bfloat16 through the production
loader (calibration report included), one batched request answered with the right images."""

from __future__ import annotations

import httpx
import pytest
import torch

from xstage_dit.features.config import ParallelConfig
from xstage_dit.server.app import create_app
from xstage_dit.server.config import ServerConfig
from xstage_dit.server.startup import model_loader
from xstage_dit.server.ranks import RankContext
from xstage_dit.server.worker import Worker
from tests.helpers.server import decode_png, live_server


@pytest.mark.gpu
def test_tiny_flux_server_on_gpu():
    worker = Worker(model_loader("tiny-flux", ParallelConfig()), ServerConfig(max_batch_size=4, api_key=None),
                    join=lambda: RankContext(device=torch.device("cuda", 0))).start()
    assert worker.wait_ready(300), worker.reason
    assert str(worker.model.pipe.transformer.dtype) == "torch.bfloat16"
    with live_server(create_app(worker)) as url, httpx.Client(base_url=url, timeout=120) as client:
        r = client.post("/v1/images/generations", json={"prompt": "a red cat", "n": 3, "size": "64x64", "seed": 11})
        assert r.status_code == 200, r.text
        images = [decode_png(d["b64_json"]) for d in r.json()["data"]]
        assert [img.shape for img in images] == [(64, 64, 3)] * 3 and r.json()["batch_size"] == 3
        assert len({img.tobytes() for img in images}) == 3
        calibration = client.get("/v1/calibration").json()["calibration"]
        assert "available" in calibration
    worker.stop()


@pytest.mark.gpu
def test_video_stream_on_gpu():
    """Tiny Wan on the GPU: each decoded chunk is copied to pinned host memory without a wait in the pipeline's
    thread (the encoder thread waits on its event), and the MP4 is the output's, byte for byte."""
    from xstage_dit.families import load_pipeline, model_spec
    from xstage_dit.runtime.generation import GenerationRequest
    from xstage_dit.server.config import ServedModel
    from xstage_dit.server.media import mp4_bytes
    from xstage_dit.server.runner import BatchRunner

    pipe = load_pipeline("tiny-wan", dtype=torch.bfloat16, device="cuda")
    served = ServedModel.from_spec("tiny-wan", model_spec("tiny-wan"))
    item = GenerationRequest(kind="video", prompt="a cat", width=64, height=64, steps=2,
                             guidance=served.default_guidance, seed=2, num_frames=17, fps=8)
    result = BatchRunner(pipe, served).run([item], lambda *a: True, stream_video=True)
    assert result.video_stream is not None
    assert result.video_stream.finish(result.pixels[0]) == mp4_bytes(result.pixels[0], 8)
