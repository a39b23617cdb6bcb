"""Cancellation across ranks without a per-step broadcast: `xstage-dit serve --sp 2` (gloo, CPU), a long
streamed request cancelled while it runs stops within a few steps on both ranks (the stop vote), and the
next request gets the single-process image: the ranks still agree, step for step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.helpers.server import assert_same_image, decode_png, free_port, reference_image, tiny

ROOT = Path(__file__).resolve().parents[2]


def test_cancel_on_two_ranks_then_serve_again():
    port = free_port()
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", PYTHONUNBUFFERED="1")
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"xstage-serve-cancel-{port}.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "xstage_dit", "serve", "--model", "tiny-flux", "--sp", "2", "--port", str(port),
         "--log-level", "warning", "--max-batch-size", "1"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    try:
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None, f"server exited: {log.seek(0) or log.read()[-3000:]}"
            assert time.time() < deadline, "2-rank server not ready within 180 s"
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        body = {"prompt": "slow", "size": "512x512", "num_inference_steps": 100, "seed": 3, "stream": True}
        events, job_id, cancelled_at = [], None, None
        with client.stream("POST", "/v1/images/generations", json=body) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                events.append(event)
                job_id = job_id or event.get("job_id")
                if event.get("steps_done", 0) >= 2 and cancelled_at is None:
                    cancelled_at = event["steps_done"]
                    assert client.delete(f"/v1/jobs/{job_id}").status_code in (200, 202)
                if "error" in event or event.get("status") in ("cancelled", "failed", "completed"):
                    break
        assert events[-1].get("error", {}).get("status") == "cancelled", events[-3:]
        # The batch itself stopped (within a few steps of the cancel), on both ranks: the worker is free.
        job = client.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "cancelled" and job["steps_done"] < 100, job
        # The ranks left the batch at the same step: the next request runs and gives the right image.
        r = client.post("/v1/images/generations", json={"prompt": "a red cat", "size": "64x64",
                                                         "num_inference_steps": 2, "seed": 5})
        assert r.status_code == 200, r.text
        pipe, served = tiny()
        want = reference_image(pipe, served, "a red cat", 5, 64, 64, 2)
        assert_same_image(decode_png(r.json()["data"][0]["b64_json"]), want, "after a cancelled batch")
        assert client.get("/health").status_code == 200
    finally:
        client.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
