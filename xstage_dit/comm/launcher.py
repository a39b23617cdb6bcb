"""Start N ranks of a command on this machine and supervise them (what ``xstage-dit generate --sp N`` uses).

Every child gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, plus the NVLink-multicast-off settings of `xstage_dit.distributed.SAFE_ENV`), so the same
program runs under torchrun or under `launch`. Supervision: when one rank exits non-zero (or is killed),
the others are terminated (SIGTERM, then SIGKILL after a grace period) and `launch` returns that rank's
exit code: a dead rank never leaves the others hanging in a collective.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence

log = logging.getLogger(__name__)

IN_LAUNCH_ENV = "XSTAGE_LAUNCHED"  # set in children: "I am one rank of a launch"


def free_port() -> int:
    """A TCP port free on localhost right now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpus_are_shared(nproc: int) -> bool:
    """True when `nproc` ranks must share GPUs (fewer GPUs than ranks): symmetric memory then needs
    TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1."""
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() < nproc


def rank_env(rank: int, world_size: int, port: int, base: dict | None = None, *, share_gpu: bool = False) -> dict:
    """The environment of rank `rank` (torchrun's variables, plus the NVLink-multicast safety variables)."""
    from xstage_dit.comm.distributed import SAFE_ENV

    env = dict(os.environ if base is None else base)
    env.update(SAFE_ENV)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{IN_LAUNCH_ENV: "1"},
    )
    if share_gpu:
        env["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    return env


def launch(
    nproc: int,
    argv: Sequence[str],
    *,
    timeout_s: float | None = None,
    grace_s: float = 5.0,
    env: dict | None = None,
    poll_s: float = 0.05,
) -> int:
    """Run `argv` as `nproc` ranks; return 0 if all exit 0, else the first failing rank's exit code.

    argv: the full command (e.g. ``[sys.executable, "-m", "xstage_dit", "generate", ...]``).
    timeout_s: kill all ranks and return 124 if they run longer. A rank killed by a signal counts as
    exit code 128 + signal.
    """
    if nproc < 1:
        raise ValueError(f"expected nproc >= 1, got {nproc}")
    if not argv:
        raise ValueError("expected a command to launch, got an empty argv")
    port = free_port()
    share_gpu = gpus_are_shared(nproc)
    # A supervisor stopped with SIGTERM (a job timeout) must take its ranks with it: they run in their
    # own sessions, so nothing else would stop them.
    def _on_term(signum, frame):
        raise KeyboardInterrupt

    import threading

    previous = signal.signal(signal.SIGTERM, _on_term) if threading.current_thread() is threading.main_thread() else None
    procs = [
        subprocess.Popen(list(argv), env=rank_env(r, nproc, port, env, share_gpu=share_gpu), start_new_session=True)
        for r in range(nproc)
    ]
    start = time.monotonic()
    code = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, c = failed[0]
                code = c if c > 0 else 128 - c
                log.error("rank %d exited with %d: stopping the other ranks", rank, code)
                print(f"xstage-dit launch: rank {rank} exited with code {code}; stopping the other ranks", file=sys.stderr)
                break
            if all(c == 0 for c in codes):
                code = 0
                break
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                print(f"xstage-dit launch: ranks still running after {timeout_s:.0f} s; stopping them", file=sys.stderr)
                code = 124
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        code = 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    stop_ranks(procs, grace_s)
    return code


def run_rank_processes(target, world_size: int, *, start_method: str = "spawn", timeout_s: float = 180.0,
                       join_s: float = 10.0) -> dict[int, object]:
    """Run ``target(rank, world_size, port, queue)`` in ``world_size`` Python processes; return ``{rank: result}``.

    Each rank puts one ``(rank, result)`` on ``queue`` (by convention a traceback string when it failed);
    ``port`` is a free localhost port for its process group. Waits up to ``timeout_s`` for each result,
    then joins every process for ``join_s`` and kills what is left. For tests and diagnostics that need
    ranks in-process; serving and benchmarks start ranks with `launch`.
    """
    import multiprocessing as mp

    ctx = mp.get_context(start_method)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world_size, port, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world_size):
            rank, res = queue.get(timeout=timeout_s)
            results[rank] = res
    finally:
        for p in procs:
            p.join(timeout=join_s)
            if p.is_alive():
                p.kill()
    return results


def stop_ranks(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM every running rank's process group, then SIGKILL what is left after `grace_s`."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
