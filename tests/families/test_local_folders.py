"""Your own weights for every family: each family's tiny pipeline, saved with ``save_pretrained`` to a folder, loads
back as the same pipeline and generates from that folder through the real `xstage-dit generate` (in-process) and
the real server (the production loader behind the HTTP app), which give the same bytes; their pixels are what the
folder's pipeline called directly gives (to the float rounding of what both commands apply: `parallelize` at world
1, batch invariance).

A folder takes the defaults of its family's published checkpoint (``full-*``: text length, guidance, multiples);
the sizes here are small ones valid for both the tiny model and those multiples, 2 steps, one torch thread (a CPU
matmul's last bit follows the thread count).
"""

from __future__ import annotations

import base64
import math
import time

import httpx
import numpy as np
import pytest
import torch

from tests.helpers.server import live_server, one_torch_thread
from xstage_dit.families import load_pipeline, model_spec
from xstage_dit.families.registry import record, records
from xstage_dit.runtime.generation import call_kwargs, output_pixels, read_mp4, run_pipeline
from xstage_dit.server.media import mp4_bytes

FAMILIES = sorted(name for name, r in records().items() if r.served_pipelines)
PROMPT, SEED, STEPS = "a red fox in the snow", 5, 2
# Families whose tiny pipeline sets instance attributes a saved folder does not keep (the pipeline's own values
# come back: a real checkpoint's), so the folder's pipeline is not the tiny one call for call:
INSTANCE_SETTINGS = {
    "hidream": "default_sample_size: the pipeline rescales every request to its 1024^2 area",
    "hunyuanvideo15": "the LLM / ByT5 / image token counts and the template crop",
    "hunyuanimage": "the LLM / ByT5 token counts and the template crop",
}
# Pixel levels (of 255) the commands' float rounding may move a pixel from the plain call's (`parallelize` at world
# 1 routes attention through its op and decodes a one-frame video VAE as a 2-D network; batch invariance runs
# narrow linears row by row); the mean stays far below a change of seed's.
MAX_LEVELS = 8


@pytest.fixture(autouse=True)
def _process_as_found():
    """`generate` restores its engine when it ends and the server's worker when it stops: the process-wide swap
    `host_syncs` makes for NucleusMoE (its module's text-length helper) must be gone after each test."""
    from diffusers.models.transformers import transformer_nucleusmoe_image as nucleusmoe

    original = nucleusmoe._compute_text_seq_len_from_mask
    yield
    # the commands restore their engine when they end: the swap must be gone, not put back by this fixture
    assert nucleusmoe._compute_text_seq_len_from_mask is original, "a command left NucleusMoE's text-length swap"


def _round_up(value: int, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple


def _values(spec, tiny) -> dict:
    """Call values valid for the folder's spec (the published multiples) and the tiny model (its own)."""
    multiple = math.lcm(spec.patch_multiple, tiny.patch_multiple)
    values = dict(width=_round_up(tiny.width, multiple), height=_round_up(tiny.height, multiple), steps=STEPS,
                  seed=SEED)
    if spec.kind == "video":
        step = math.lcm(spec.frame_multiple, tiny.frame_multiple)
        values["frames"] = 1 + _round_up(tiny.frames - 1, step)
    return values


def _pixels(pipe, spec, values: dict) -> np.ndarray:
    """uint8 (H, W, C) or (frames, H, W, C): the pipeline called directly (the first sample)."""
    return output_pixels(run_pipeline(pipe, **call_kwargs(pipe, spec, prompt=PROMPT, **values)), spec.kind)[0]


def _cli(folder, spec, values: dict, out) -> bytes:
    from xstage_dit.cli import main

    argv = ["generate", "--model", str(folder), "--prompt", PROMPT, "--seed", str(values["seed"]), "--steps",
            str(values["steps"]), "--width", str(values["width"]), "--height", str(values["height"]),
            "--device", "cpu", "--output", str(out), "--no-progress"]
    if spec.kind == "video":
        argv += ["--frames", str(values["frames"])]
    assert main(argv) == 0
    return out.read_bytes()


def _served(folder, spec, values: dict) -> bytes:
    """The PNG or MP4 bytes of one request to the production loader of `folder` behind the HTTP app."""
    from xstage_dit.features.config import ParallelConfig
    from xstage_dit.server.app import create_app
    from xstage_dit.server.config import ServerConfig
    from xstage_dit.server.ranks import RankContext
    from xstage_dit.server.startup import model_loader
    from xstage_dit.server.worker import Worker

    config = ServerConfig(api_key=None, warmup=False, max_batch_size=1)
    worker = Worker(model_loader(str(folder), ParallelConfig()), config,
                    join=lambda: RankContext(device=torch.device("cpu"))).start()
    try:
        assert worker.wait_ready(300), worker.reason
        body = {"prompt": PROMPT, "seed": values["seed"], "size": f"{values['width']}x{values['height']}",
                "num_inference_steps": values["steps"]}
        with live_server(create_app(worker)) as url, httpx.Client(base_url=url, timeout=300) as client:
            models = client.get("/v1/models").json()["data"]
            assert [m["id"] for m in models] == [folder.name]
            if spec.kind == "image":
                r = client.post("/v1/images/generations", json=body)
                assert r.status_code == 200, r.text
                return base64.b64decode(r.json()["data"][0]["b64_json"])
            r = client.post("/v1/videos", json={**body, "num_frames": values["frames"]})
            assert r.status_code == 202, r.text
            job = r.json()["id"]
            deadline = time.monotonic() + 300
            while (status := client.get(f"/v1/videos/{job}").json())["status"] not in ("completed", "failed"):
                assert time.monotonic() < deadline, status
                time.sleep(0.05)
            assert status["status"] == "completed", status
            return client.get(f"/v1/videos/{job}/content").content
    finally:
        worker.stop()


def _decoded(data: bytes, kind: str) -> np.ndarray:
    if kind == "video":
        return read_mp4(data)
    from PIL import Image
    import io

    return np.asarray(Image.open(io.BytesIO(data)))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_saved_tiny_pipeline_serves_and_generates_from_its_folder(family, tmp_path):
    tiny_spec = record(family).spec("tiny")
    folder = tmp_path / f"my-{family}"
    with one_torch_thread():
        tiny = load_pipeline(tiny_spec.name, seed=0)
        tiny.save_pretrained(folder)
        spec = model_spec(str(folder))
        assert (spec.family, spec.size, spec.pipeline_class, spec.random_weights) == (
            family, "local", tiny_spec.pipeline_class, False)
        values = _values(spec, tiny_spec)
        pipe = load_pipeline(str(folder))
        assert type(pipe) is type(tiny)
        if family not in INSTANCE_SETTINGS:  # the folder is the tiny pipeline: the same call, the same bytes
            np.testing.assert_array_equal(_pixels(pipe, tiny_spec, values), _pixels(tiny, tiny_spec, values))
        direct = _pixels(pipe, spec, values)
        other_seed = _pixels(pipe, spec, {**values, "seed": SEED + 1})
        del tiny, pipe
        suffix = ".mp4" if spec.kind == "video" else ".png"
        cli = _cli(folder, spec, values, tmp_path / f"cli{suffix}")
        served = _served(folder, spec, values)
    assert cli == served  # one loader, one request rule, one encoder
    got = _decoded(served, spec.kind).astype(np.int16)
    if spec.kind == "video":  # MP4 is lossy: compare with the direct call's frames through the same encoder
        direct, other_seed = (read_mp4(mp4_bytes(frames[..., :3], spec.fps)) for frames in (direct, other_seed))
    assert got.shape == direct.shape, (got.shape, direct.shape)
    err, err_other = np.abs(got - direct).mean(), np.abs(got - other_seed).mean()
    assert err < 0.5 and err < err_other / 10, (err, err_other)  # the commands' rounding, not another image
    if spec.kind == "image":
        assert np.abs(got - direct).max() <= MAX_LEVELS
