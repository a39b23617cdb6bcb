"""A server over an already-built pipeline, in this process: the worker thread plus uvicorn on a free
127.0.0.1 port, for the benchmarks (the served contender of `xstage-dit bench`, the load test of
benchmarks/bench_serving.py) that time the same request through HTTP that they time on the bare pipeline.

Example::

    with serve_pipeline(pipe, "full-flux", spec, batching="never") as (url, worker):
        httpx.post(f"{url}/v1/images/generations", json={"prompt": "a fox", "size": "1024x1024"})
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Iterator

import torch

from xstage_dit.server.config import ServedModel, ServerConfig
from xstage_dit.server.ranks import LoadedModel, RankContext
from xstage_dit.server.worker import Worker


def loopback_listener() -> socket.socket:
    """A TCP socket bound to a free 127.0.0.1 port, for uvicorn's ``sockets=``.

    IPPROTO_TCP is named explicitly: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets whose
    protocol says TCP, and ``socket.socket()`` says 0. With Nagle on, an answer's body waited for the client's
    delayed ACK of its headers: every POST to the in-process server took tens of milliseconds more than the same app
    bound by uvicorn itself (as ``xstage-dit serve`` does), which the served benchmark contenders counted as serving
    overhead (benchmarks/results/serving/http-transport-cpu-2core.md). TCP_NODELAY is also set here, for accepted
    sockets to inherit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def uvicorn_thread(app: Any, sock: socket.socket | None = None, *, name: str = "xstage-inprocess-http",
                   start_timeout_s: float = 30.0) -> Iterator[int]:
    """Run `app` under uvicorn in a daemon thread, on `sock` (e.g. `loopback_listener()`) or on a port uvicorn
    binds itself on 127.0.0.1; yields the port once uvicorn has started, stops it on exit."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={} if sock is None else {"sockets": [sock]}, name=name,
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"expected uvicorn to start within {start_timeout_s:.0f} s, it did not")
        time.sleep(0.02)
    try:
        yield (sock or server.servers[0].sockets[0]).getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def serve_pipeline(pipe: Any, name: str, spec: Any, *, ready_timeout_s: float = 900.0, report: dict | None = None,
                   **config: Any) -> Iterator[tuple[str, Worker]]:
    """Serve `pipe` (already parallelized/compiled as wanted) as model `name` of `spec` (a ModelSpec).

    config: `ServerConfig` fields (api_key defaults to None here). Yields (base URL, the running Worker);
    stops both on exit. RuntimeError when the worker does not get ready (its reason).
    """
    from xstage_dit.server.app import create_app

    config.setdefault("api_key", None)
    server_config = ServerConfig(**config)
    served = ServedModel.from_spec(name, spec)
    device = getattr(pipe, "device", torch.device("cpu"))
    loaded = LoadedModel(pipe, served, report or {"model": name, "calibration": None})
    worker = Worker(lambda ctx: loaded, server_config, join=lambda: RankContext(device=device)).start()
    try:
        if not worker.wait_ready(ready_timeout_s):
            raise RuntimeError(f"expected the in-process server to get ready, got {worker.state}: {worker.reason}")
        with contextlib.closing(loopback_listener()) as sock, uvicorn_thread(create_app(worker), sock) as port:
            yield f"http://127.0.0.1:{port}", worker
    finally:
        worker.stop()
