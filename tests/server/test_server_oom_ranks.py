"""Out of memory on one of two sequence-parallel ranks (tiny FLUX, sp=2, gloo, with a LoRA adapter): the request
fails on both ranks at once with a 507 naming it, both ranks rebuild their groups (`server.recovery`), /health
stays ready, and the next request's image is byte for byte the one before the failure.

The trigger is a test double (a forward pre-hook on rank 1 raising torch.OutOfMemoryError at its third transformer
forward, the first of the second request); everything that handles it is the server's own path. Run as its own
rank program (``python FILE OUT WORLD``) by `tests.helpers.family_harness.launch_ranks`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests.helpers.family_harness import launch_ranks  # noqa: E402

BODY = {"prompt": "a red cat on a sofa", "seed": 7, "num_inference_steps": 2, "size": "32x32",
        "lora": [{"name": "a", "scale": 0.8}]}


def rank_main(out: str, world: int) -> int:
    import base64

    import httpx

    from xstage_dit.families import load_pipeline
    from xstage_dit.features.config import ParallelConfig
    from xstage_dit.server.app import create_app
    from xstage_dit.server.config import ServerConfig
    from xstage_dit.server.ranks import RankContext
    from xstage_dit.server.startup import model_loader
    from xstage_dit.server.worker import Worker
    from tests.helpers.lora import write_peft
    from tests.helpers.server import live_server

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    lora_dir = Path(f"{out}.loras{rank}")
    write_peft(load_pipeline("tiny-flux", dtype=torch.float32, device="cpu", seed=0).transformer,
               lora_dir / "a.safetensors", rank=4, seed=1)
    base = model_loader("tiny-flux", ParallelConfig(sp=world, timeout_s=120), lora={"lora_dir": str(lora_dir)})
    forwards = [0]

    def load(ctx):
        loaded = base(ctx)
        if ctx.rank == 1:
            def out_of_memory(module, args):
                forwards[0] += 1
                if forwards[0] == 3:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 1; 79 GiB)")

            loaded.pipe.transformer.transformer_blocks[0].register_forward_pre_hook(out_of_memory)
        return loaded

    config = ServerConfig(api_key=None, warmup=False, max_batch_size=1, parallel=ParallelConfig(sp=world, timeout_s=120),
                          heartbeat_timeout_s=60, exit_after_failure_s=None)
    worker = Worker(load, config, join=lambda: RankContext.join(120))
    if rank != 0:  # as `xstage-dit serve` ends a rank: its daemon threads may still be in a collective
        code = worker.run_follower()
        Path(f"{out}.{rank}").write_text(json.dumps({"forwards": forwards[0]}))
        sys.stderr.flush()
        os._exit(code)
    worker.start()
    results = {}
    try:
        assert worker.wait_ready(300), worker.reason
        with live_server(create_app(worker)) as url, httpx.Client(base_url=url, timeout=300) as client:
            answers = [client.post("/v1/images/generations", json=BODY) for _ in range(2)]
            results["health"] = [client.get("/health").status_code, client.get("/health").json()["status"]]
            answers.append(client.post("/v1/images/generations", json=BODY))
        results["codes"] = [r.status_code for r in answers]
        results["error"] = answers[1].json()["error"]["message"] if answers[1].status_code != 200 else None
        pngs = [base64.b64decode(r.json()["data"][0]["b64_json"]) for r in answers if r.status_code == 200]
        results["same_image"] = len(pngs) == 2 and pngs[0] == pngs[1]
        results["recoveries"] = worker.model.recovery.generation
    finally:
        worker.stop()
        Path(f"{out}.{rank}").write_text(json.dumps(results))
    return 0


def test_out_of_memory_on_one_rank_fails_the_request_on_all_and_the_next_is_unchanged(tmp_path):
    rank0, rank1 = launch_ranks(__file__, "oom", 2, tmp_path)
    assert rank1["forwards"] == 5, rank1  # 2 steps, the failed first forward of the second request, 2 steps
    assert rank0["codes"] == [200, 507, 200], rank0
    assert rank0["health"] == [200, "ready"], rank0
    assert "out of memory" in rank0["error"] and "32x32" in rank0["error"] and "LoRA a:0.8" in rank0["error"], rank0
    assert "GiB" not in rank0["error"], rank0  # no allocator internals
    assert rank0["same_image"] and rank0["recoveries"] == 1, rank0


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1], int(sys.argv[2])))
