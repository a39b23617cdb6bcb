"""On a GPU: a request that does not fit because another allocation holds the memory gets a 507 naming it, the
server stays ready, and once the memory is back the next image is byte-identical to the one before; and a compiled
server (inductor) switches adapters with no recompile after its warm-up, unfused (hot-swap slots), fused (weights
merged in place) and auto (which fuses there: a tiny model's saved copy fits)."""

from __future__ import annotations

import base64

import httpx
import pytest
import torch

from xstage_dit.features.config import ParallelConfig
from xstage_dit.server.app import create_app
from xstage_dit.server.config import ServerConfig
from xstage_dit.server.ranks import RankContext
from xstage_dit.server.startup import model_loader
from xstage_dit.server.worker import Worker
from tests.helpers.lora import QV_ONLY, write_peft
from tests.helpers.server import live_server

pytestmark = pytest.mark.gpu
SIZE = 1024
BODY = {"prompt": "a red cat on a sofa", "seed": 7, "num_inference_steps": 2, "size": f"{SIZE}x{SIZE}",
        "lora": [{"name": "a", "scale": 0.8}]}
# What a request of SIZE^2 must hold at once, whatever the model's width: its decoded image, 3 channels of SIZE^2
# pixels at 2 bytes (bf16) or more. No block that large may be left once the device is filled.
NEEDED_BYTES = 3 * SIZE * SIZE * 2


def _server(lora_dir, compile_mode: str, lora_mode: str = "auto"):
    loader = model_loader("tiny-flux", ParallelConfig(), compile=compile_mode,
                          lora={"lora_dir": str(lora_dir), "lora_mode": lora_mode})
    worker = Worker(loader, ServerConfig(api_key=None, max_batch_size=1, warmup_sizes=((SIZE, SIZE),)),
                    join=lambda: RankContext(device=torch.device("cuda"))).start()
    assert worker.wait_ready(900), worker.reason
    return worker


def _adapters(tmp_path):
    from xstage_dit.families import load_pipeline

    shapes = load_pipeline("tiny-flux", dtype=torch.float32, device="cpu", seed=0).transformer
    write_peft(shapes, tmp_path / "a.safetensors", rank=4, seed=1)
    write_peft(shapes, tmp_path / "b.safetensors", rank=4, seed=2, words=QV_ONLY)


def _fill_device(smallest: int = 1 << 20) -> list[torch.Tensor]:
    """Another allocation taking every block this process can get, down to `smallest` bytes: the caching allocator's
    free blocks first (the server shares this process and its allocator: what its warm-up left cached inside
    segments that stay reserved, which emptying the cache cannot give back, is reused by the fill), then the
    driver's free memory. Sizes halve on each refusal, so what is left is smaller than `smallest` per block or
    than one of the allocator's segments (a 2 MiB one for small blocks)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    hogs, size = [], max(free, cached)
    while size >= smallest:
        try:
            hogs.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            size //= 2
    return hogs


def test_out_of_memory_from_another_allocation_is_a_507_and_the_next_image_is_unchanged(tmp_path):
    _adapters(tmp_path)
    worker = _server(tmp_path, "off")
    try:
        with live_server(create_app(worker)) as url, httpx.Client(base_url=url, timeout=600) as client:
            before = client.post("/v1/images/generations", json=BODY)
            assert before.status_code == 200, before.text
            hogs = _fill_device()
            try:
                with pytest.raises(torch.OutOfMemoryError):  # the fill left no block the request could use
                    torch.empty(NEEDED_BYTES, dtype=torch.uint8, device="cuda")
                refused = client.post("/v1/images/generations", json=BODY)
                health = client.get("/health")
            finally:
                del hogs
                torch.cuda.empty_cache()
            assert refused.status_code == 507, refused.text
            message = refused.json()["error"]["message"]
            assert f"{SIZE}x{SIZE}" in message and "LoRA a:0.8" in message and "GiB" not in message, message
            assert health.status_code == 200 and health.json()["status"] == "ready"
            after = client.post("/v1/images/generations", json=BODY)
            assert after.status_code == 200, after.text
            assert base64.b64decode(after.json()["data"][0]["b64_json"]) == \
                base64.b64decode(before.json()["data"][0]["b64_json"])
    finally:
        worker.stop()


@pytest.mark.parametrize("lora_mode", ["unfused", "fused", "auto"])
def test_a_compiled_server_switches_adapters_without_recompiling(lora_mode, tmp_path):
    from xstage_dit import _torch_private as tp

    _adapters(tmp_path)
    worker = _server(tmp_path, "regional", lora_mode)
    try:
        with live_server(create_app(worker)) as url, httpx.Client(base_url=url, timeout=600) as client:
            converted = tp.frames_converted()
            answers, modes = [], []
            for lora in (["a"], ["b"], [], ["a"], [{"name": "b", "scale": 0.3}], []):
                answers.append(client.post("/v1/images/generations", json={**BODY, "lora": lora}))
                modes.append(client.get("/v1/loras").json()["mode_in_use"])
            assert [r.status_code for r in answers] == [200] * 6, [r.text[:200] for r in answers]
            assert tp.frames_converted() == converted, "a switch recompiled after warm-up"
        pngs = [base64.b64decode(r.json()["data"][0]["b64_json"]) for r in answers]
        assert pngs[0] == pngs[3] and pngs[2] == pngs[5] and len({pngs[0], pngs[1], pngs[2], pngs[4]}) == 4
        used = "unfused" if lora_mode == "unfused" else "fused"
        assert modes == [used, used, None, used, used, None], modes
    finally:
        worker.stop()
