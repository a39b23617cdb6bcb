"""Start a few ranks of a worker script on one machine (gloo on a free port), with a timeout."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: Path, world_size: int, args: list[str], timeout_s: float = 120.0,
           extra_env: dict[str, str] | None = None) -> list[dict]:
    """Run `world_size` copies of `script`; return each rank's last JSON line. Raises on failure or timeout.

    Retried once on a fresh port when the rendezvous port was taken in between (tests run in parallel)."""
    try:
        return _launch_once(script, world_size, args, timeout_s, extra_env)
    except AssertionError as exc:
        if "address already in use" not in str(exc).lower():
            raise
        return _launch_once(script, world_size, args, timeout_s, extra_env)


def _launch_once(script, world_size, args, timeout_s, extra_env) -> list[dict]:
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ)
        env.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "PYTHONPATH": f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"})
        env.update(extra_env or {})
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs, failed = [], []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"rank {rank} timed out after {timeout_s} s")
        lines = [line for line in out.splitlines() if line.startswith("{")]
        outputs.append(json.loads(lines[-1]) if lines else {})
        if proc.returncode != 0:
            failed.append(f"rank {rank} exit {proc.returncode}: {outputs[-1]}\n{err[-3000:]}")
    if failed:
        raise AssertionError("\n".join(failed))
    return outputs
