"""Starting and supervising the serving ranks on one node (what torchrun would do, without its agent
killing rank 0 when another rank dies: rank 0 must stay up to answer 503 and report the failure).

Each rank is a copy of the same `xstage-dit serve ...` command with torchrun's environment (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). The supervisor forwards SIGINT /
SIGTERM to rank 0 (which stops the others), and when rank 0 exits it stops the others and exits with rank 0's code.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

log = logging.getLogger(__name__)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def supervise(world_size: int, argv: list[str], master_addr: str = "127.0.0.1") -> int:
    """Run `python -m xstage_dit <argv>` as `world_size` ranks; return rank 0's exit code."""
    if world_size < 2:
        raise ValueError(f"expected world_size >= 2 for a supervised launch, got {world_size}")
    port = _free_port(master_addr)
    procs: list[subprocess.Popen] = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR=master_addr,
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "xstage_dit", *argv], env=env))
    print(f"xstage-dit serve: started {world_size} ranks (pids {', '.join(str(p.pid) for p in procs)})",
          file=sys.stderr, flush=True)

    def forward(signum, _frame):
        # Rank 0 shuts down cleanly and tells the other ranks to stop; they are killed if they linger.
        if procs[0].poll() is None:
            procs[0].send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    reported: set[int] = set()
    try:
        while True:
            code0 = procs[0].poll()
            if code0 is not None:
                _stop(procs[1:])
                return code0
            for rank, p in enumerate(procs[1:], start=1):
                code = p.poll()
                if code is not None and rank not in reported:
                    reported.add(rank)
                    # Rank 0 notices (heartbeat), answers 503, and exits after its grace period.
                    print(f"xstage-dit serve: rank {rank} (pid {p.pid}) exited with code {code}",
                          file=sys.stderr, flush=True)
            time.sleep(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _stop(procs)
