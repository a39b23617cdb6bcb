"""Starting and supervising the serving ranks on one node (what torchrun would do, without its agent
killing rank 0 when another rank dies: rank 0 must stay up to answer 503 and report the failure).

Each rank is a copy of the same `xstage-dit serve ...` command with torchrun's environment (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). The supervisor forwards SIGINT /
SIGTERM to rank 0 (which stops the others), and when rank 0 exits it stops the others and exits with rank 0's code.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time

from xstage_dit.comm.launcher import free_port, gpus_are_shared, rank_env, stop_ranks

log = logging.getLogger(__name__)


def supervise(world_size: int, argv: list[str]) -> int:
    """Run `python -m xstage_dit <argv>` as `world_size` ranks; return rank 0's exit code."""
    if world_size < 2:
        raise ValueError(f"expected world_size >= 2 for a supervised launch, got {world_size}")
    port = free_port()
    share_gpu = gpus_are_shared(world_size)
    # Own process groups: a terminal's Ctrl-C reaches the supervisor only, which forwards it to rank 0.
    procs = [subprocess.Popen([sys.executable, "-m", "xstage_dit", *argv], start_new_session=True,
                              env=rank_env(rank, world_size, port, share_gpu=share_gpu))
             for rank in range(world_size)]
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
                stop_ranks(procs[1:])
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
        stop_ranks(procs)
