"""Helpers of the Ray Serve tests: a local Ray cluster on the CPU (logical CPUs, so a 2-core machine can hold two
replicas of two ranks), the deployment of `DeployOptions` on it, and a client that tells which replica answered.

The cluster's workers import the checkout (PYTHONPATH of the runtime environment), not an installed copy."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import httpx

from tests.helpers.server import free_port
from xstage_dit.deploy.ingress import REPLICA_HEADER

ROOT = Path(__file__).resolve().parents[2]
#: logical CPUs of the test cluster: one per rank (bundles of 1 CPU) for 2 replicas of 2 ranks, with room for a
#: replacement replica starting while a failed one drains
CLUSTER_CPUS = 6


@contextlib.contextmanager
def ray_cluster(num_cpus: int = CLUSTER_CPUS):
    """A local Ray cluster and Serve's HTTP proxy on a free port; yields the base URL. Shut down on exit."""
    import ray
    from ray import serve

    ray.init(num_cpus=num_cpus, num_gpus=0, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
                                       "TRANSFORMERS_VERBOSITY": "error"}})
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(options, timeout_s: float = 600.0) -> float:
    """Run the application of `options` (replacing one of the same name); returns the seconds it took to be ready."""
    from ray import serve

    from xstage_dit.deploy.application import build

    started = time.monotonic()
    serve.run(build(options), name=options.app_name, route_prefix="/", blocking=False)
    deadline = started + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get(options.app_name)
        if status is not None and status.status == "RUNNING":
            return time.monotonic() - started
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"deploy failed: {status.message}")
        time.sleep(0.1)
    raise TimeoutError(f"application {options.app_name} not running within {timeout_s:.0f} s")


def replica_of(response: httpx.Response) -> str:
    """The replica that answered (the `X-Xstage-Replica` header every answer carries)."""
    value = response.headers.get(REPLICA_HEADER.decode())
    assert value, f"expected an {REPLICA_HEADER.decode()} header, got {dict(response.headers)}"
    return value


def running_replicas(app_name: str, deployment: str = "engine") -> int:
    """Replicas of the deployment that Serve reports running."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None or deployment not in app.deployments:
        return 0
    return app.deployments[deployment].replica_states.get("RUNNING", 0)


def single_process_pngs(prompt: str, seeds, size: int, steps: int, model: str = "tiny-flux") -> dict[int, bytes]:
    """{seed: PNG bytes} of the production loader at world 1 behind the in-process server, one torch thread (a CPU
    matmul's last bit follows the thread count, and a replica's ranks run one thread each)."""
    import base64

    import torch

    from tests.helpers.server import live_server, one_torch_thread
    from xstage_dit.features.config import ParallelConfig
    from xstage_dit.server.app import create_app
    from xstage_dit.server.config import ServerConfig
    from xstage_dit.server.ranks import RankContext
    from xstage_dit.server.startup import model_loader
    from xstage_dit.server.worker import Worker

    config = ServerConfig(api_key=None, warmup=False, max_batch_size=1, gc_freeze=False)
    worker = Worker(model_loader(model, ParallelConfig()), config, join=lambda: RankContext(device=torch.device("cpu")))
    with one_torch_thread():
        worker.start()
        try:
            assert worker.wait_ready(300), worker.reason
            with live_server(create_app(worker)) as url, httpx.Client(base_url=url, timeout=300) as client:
                out = {}
                for seed in seeds:
                    r = client.post("/v1/images/generations", json={"prompt": prompt, "seed": seed, "size": f"{size}x{size}",
                                                                    "num_inference_steps": steps})
                    assert r.status_code == 200, r.text
                    out[seed] = base64.b64decode(r.json()["data"][0]["b64_json"])
                return out
        finally:
            worker.stop()
