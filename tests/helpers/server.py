"""Helpers of the server tests: the tiny real pipelines, an in-process worker, a live uvicorn server on
127.0.0.1, a multi-rank `xstage-dit serve` subprocess, and reference images computed by calling the
pipeline directly."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import signal
import socket
import time
from pathlib import Path

import numpy as np
import torch

from xstage_dit.runtime.generation import to_uint8
from xstage_dit.server.config import ServedModel, ServerConfig
from xstage_dit.server.ranks import LoadedModel
from xstage_dit.server.worker import Worker


@contextlib.contextmanager
def one_torch_thread():
    """One intra-op thread while the test process also runs an HTTP server and clients: on a busy 2-core
    machine two OpenMP threads spin against those threads and a batch takes 5-10x longer."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny(model: str = "tiny-flux", seed: int = 0):
    """(pipeline, ServedModel) of a built-in tiny model: real diffusers classes, random weights."""
    from xstage_dit.families import load_pipeline, model_spec

    pipe = load_pipeline(model, dtype=torch.float32, device="cpu", seed=seed)
    return pipe, ServedModel.from_spec(model, model_spec(model))


def start_worker(config: ServerConfig, model: str = "tiny-flux") -> Worker:
    pipe, served = tiny(model)
    worker = Worker(lambda ctx: LoadedModel(pipe, served, {"model": served.name, "calibration": None}), config)
    worker.start()
    assert worker.wait_ready(60), worker.reason
    return worker


@contextlib.contextmanager
def live_server(app):
    """Run `app` under uvicorn on a free 127.0.0.1 port in a thread; yields the base URL."""
    from xstage_dit.server.inprocess import uvicorn_thread

    with uvicorn_thread(app, name="test-http") as port:
        yield f"http://127.0.0.1:{port}"


def decode_png(b64: str) -> np.ndarray:
    from PIL import Image

    return np.array(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def reference_image(pipe, served: ServedModel, prompt: str, seed: int, width: int, height: int, steps: int,
                    guidance: float | None = None) -> np.ndarray:
    """uint8 (height, width, 3): the pipeline called directly for one prompt and one seed."""
    out = pipe(prompt, height=height, width=width, num_inference_steps=steps,
               guidance_scale=served.default_guidance if guidance is None else guidance,
               generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **served.pipeline_kwargs)
    return to_uint8(np.asarray(out.images[0]))


def assert_same_image(got: np.ndarray, want: np.ndarray, what: str = "image") -> None:
    """Equal up to one uint8 level: batched matmuls round differently in fp32 (about 1e-6 here), which
    can move a pixel across a rounding boundary; a swapped or wrong image differs by far more."""
    assert got.shape == want.shape, f"{what}: expected shape {want.shape}, got {got.shape}"
    diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
    assert diff.max() <= 1, f"{what}: max pixel difference {diff.max()} (mean {diff.mean():.3f})"


@contextlib.contextmanager
def multirank_server(*serve_args: str, sp: int = 2, model: str = "tiny-flux", log_name: str = "serve",
                     client_timeout_s: float = 60, ready_within_s: float = 180):
    """`xstage-dit serve --model MODEL --sp SP SERVE_ARGS...` as a subprocess (the command starts its own rank
    processes over gloo), yielded once `/health` answers 200 as ``(client, proc, log)``: an httpx client on
    it, the Popen of the command and its open log (stdout and stderr). Stopped with SIGTERM (then killed)
    on exit. Fails naming the log tail when the server exits, or is not ready within `ready_within_s`."""
    import subprocess
    import sys

    import httpx

    root = Path(__file__).resolve().parents[2]
    port = free_port()
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", PYTHONUNBUFFERED="1")
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"xstage-{log_name}-{port}.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "xstage_dit", "serve", "--model", model, "--sp", str(sp), "--port", str(port),
         *serve_args], cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=client_timeout_s)
    try:
        deadline = time.time() + ready_within_s
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}: {log.seek(0) or log.read()[-3000:]}"
            assert time.time() < deadline, f"{sp}-rank server not ready within {ready_within_s:.0f} s"
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield client, proc, log
    finally:
        client.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
