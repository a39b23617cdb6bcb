"""Start N ranks of a command on this machine and supervise them: the one launcher behind
``xstage-dit generate --sp N``, ``xstage-dit serve --sp N``, ``xstage-dit bench`` and the multi-rank tests.

Every child gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, plus the NVLink-multicast-off settings of `xstage_dit.comm.distributed.SAFE_ENV`, applied
here to the children), so the same program runs under torchrun or under `launch`. Ranks run in their own
sessions and are stopped by `stop_ranks` (SIGTERM to the process group, SIGKILL after a grace period).

Two supervision policies, one loop (`supervise`):

- ``any`` (generate, bench, tests): when one rank exits non-zero (or is killed) the others are stopped
  and `launch` returns that rank's exit code: a dead rank never leaves the others hanging in a collective.
- ``leader`` (serve): rank 0 decides. SIGINT / SIGTERM are forwarded to rank 0 (which tells the others to
  stop); another rank's exit is reported and left to rank 0 (it answers 503, then exits); when rank 0
  exits the others are stopped and its code is returned. torchrun's agent would kill rank 0 instead.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

log = logging.getLogger(__name__)


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
    from xstage_dit.comm.distributed import apply_safe_env

    env = apply_safe_env(dict(os.environ if base is None else base), force=True)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    if share_gpu:
        env["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    return env


def start_ranks(nproc: int, argv: Sequence[str], env: dict | None = None) -> list[subprocess.Popen]:
    """Start `argv` as `nproc` ranks (own sessions, so a terminal's Ctrl-C reaches the supervisor only)."""
    if nproc < 1:
        raise ValueError(f"expected nproc >= 1, got {nproc}")
    if not argv:
        raise ValueError("expected a command to launch, got an empty argv")
    port = free_port()
    share_gpu = gpus_are_shared(nproc)
    return [subprocess.Popen(list(argv), env=rank_env(r, nproc, port, env, share_gpu=share_gpu),
                             start_new_session=True) for r in range(nproc)]


def shell_exit_code(code: int) -> int:
    """A process's return code as a shell reports it: the code, or 128 + s for a process killed by signal s
    (which ``subprocess`` / ``multiprocessing`` report as -s)."""
    return code if code >= 0 else 128 - code


class _ExitOrder:
    """Which ranks have exited, in the order they exited: one waiter thread a rank, each stamping its
    rank's exit as it happens. A poll loop cannot tell two exits within one poll apart, and under "any"
    the first failure is the cause: rank 1 raising makes rank 0's collective fail a few ms later
    ("Connection closed by peer"), and it is rank 1's code the user needs to see."""

    def __init__(self, procs: list[subprocess.Popen]):
        self._lock = threading.Lock()
        self._exits: list[tuple[int, int]] = []  # (rank, exit code), in exit order
        for rank, proc in enumerate(procs):
            threading.Thread(target=self._wait, args=(rank, proc), daemon=True,
                             name=f"launcher-wait-{rank}").start()

    def _wait(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        with self._lock:
            self._exits.append((rank, shell_exit_code(code)))

    def exits(self) -> list[tuple[int, int]]:
        """(rank, exit code) of every rank that has exited so far, first exit first."""
        with self._lock:
            return list(self._exits)


def supervise(procs: list[subprocess.Popen], *, policy: str = "any", timeout_s: float | None = None,
              poll_s: float = 0.05, label: str = "xstage-dit launch") -> int:
    """Wait for the ranks under `policy` ("any" or "leader", see the module) and return the exit code
    (124 after `timeout_s`, 130 when interrupted). Under "any" the code is that of the rank that failed
    first, not of the lowest failed rank (a rank's death makes its peers fail right after it).
    Does not stop the ranks: `launch` does."""
    if policy not in ("any", "leader"):
        raise ValueError(f"expected policy 'any' or 'leader', got {policy!r}")
    start = time.monotonic()
    order = _ExitOrder(procs)
    reported: set[int] = set()
    while True:
        exits = order.exits()
        if policy == "leader":
            for rank, code in exits:
                if rank == 0:
                    return code
                if rank not in reported:
                    reported.add(rank)  # rank 0 notices (heartbeat), answers 503, exits after its grace period
                    print(f"{label}: rank {rank} (pid {procs[rank].pid}) exited with code {code}",
                          file=sys.stderr, flush=True)
        else:
            failed = [(r, c) for r, c in exits if c != 0]
            if failed:
                rank, code = failed[0]
                log.error("rank %d exited with %d: stopping the other ranks", rank, code)
                print(f"{label}: rank {rank} exited with code {code}; stopping the other ranks", file=sys.stderr)
                return code
            if len(exits) == len(procs):
                return 0
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            print(f"{label}: ranks still running after {timeout_s:.0f} s; stopping them", file=sys.stderr)
            return 124
        time.sleep(poll_s)


def launch(
    nproc: int,
    argv: Sequence[str],
    *,
    timeout_s: float | None = None,
    grace_s: float = 5.0,
    env: dict | None = None,
    poll_s: float = 0.05,
    policy: str = "any",
    label: str = "xstage-dit launch",
) -> int:
    """Run `argv` as `nproc` ranks under `policy`; return the exit code `supervise` gives.

    argv: the full command (e.g. ``[sys.executable, "-m", "xstage_dit", "generate", ...]``).
    timeout_s: stop all ranks and return 124 if they run longer. A rank killed by a signal counts as
    exit code 128 + signal. Every rank is stopped (`stop_ranks`) before this returns.
    """
    if policy not in ("any", "leader"):
        raise ValueError(f"expected policy 'any' or 'leader', got {policy!r}")
    procs = start_ranks(nproc, argv, env)
    if policy == "leader":
        print(f"{label}: started {nproc} ranks (pids {', '.join(str(p.pid) for p in procs)})",
              file=sys.stderr, flush=True)

    def on_signal(signum, frame):
        if policy == "any":
            raise KeyboardInterrupt  # a supervisor stopped by a job timeout takes its ranks with it
        if procs[0].poll() is None:  # rank 0 shuts down cleanly and tells the other ranks to stop
            procs[0].send_signal(signum)

    signals = (signal.SIGTERM,) if policy == "any" else (signal.SIGTERM, signal.SIGINT)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, on_signal) for s in signals} if main_thread else {}
    try:
        code = supervise(procs, policy=policy, timeout_s=timeout_s, poll_s=poll_s, label=label)
    except KeyboardInterrupt:
        code = 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
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
