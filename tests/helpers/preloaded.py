"""Rank programs forked from a process that imported torch, diffusers, transformers and the package once.

A rank started as ``python FILE ...`` spends seconds of CPU importing those before its first line of work, more
than the work itself in most of the tests' parity runs (tiny pipelines, four ranks on the 2-core CI machine), and
the suite starts about eighty such ranks. Here each rank is a child of a fork server (`multiprocessing`'s
``forkserver``, started once per test process with `tests.helpers.rank_preload` imported and nothing run), given
the environment the product's launcher gives its ranks (`xstage_dit.comm.launcher.rank_env`), its ``sys.argv`` and
its program run as ``__main__``: the same program with the same variables, its imports already done. Supervised as
the launcher's "any" policy does: a rank that fails stops the others, and its code is returned.

The product's launcher (``xstage_dit.comm.launcher.launch``: ``generate --sp``, ``serve --sp``, and the tests of
those, of the launcher and of a dying rank) still starts fresh interpreters; this is only how the tests' own rank
programs start."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Sequence

# Imported in the fork server, which runs nothing else: no thread or OpenMP pool exists when it forks.
PRELOAD = ["tests.helpers.rank_preload"]
# Read by the libraries as they are imported, so the server must hold the ranks' values when it imports them.
IMPORT_TIME_ENV = {"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}

_context: multiprocessing.context.ForkServerContext | None = None


def _server() -> multiprocessing.context.ForkServerContext:
    global _context
    if _context is None:
        from multiprocessing import forkserver

        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        saved = {k: os.environ.get(k) for k in IMPORT_TIME_ENV}
        os.environ.update(IMPORT_TIME_ENV)
        try:
            forkserver.ensure_running()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        _context = context
    return _context


def _run_rank(program: str, args: list[str], env: dict, log: str) -> None:
    """In the forked rank: its output to `log`, its environment and argv, then `program` as ``__main__`` (its
    ``sys.exit(code)`` is the rank's exit code)."""
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [program, *args]
    sys.path.insert(0, str(Path(program).parent))  # as `python FILE` puts the file's folder first
    runpy.run_path(program, run_name="__main__")


def launch_preloaded(world: int, program: str, args: Sequence[str], *, env: dict, timeout_s: float,
                     logs: Path) -> int:
    """Run `program` (a script whose ``__main__`` reads RANK / WORLD_SIZE / MASTER_*) as `world` ranks forked from
    the preloaded server; each rank's output goes to ``logs.<rank>.log`` and is echoed to this process's stderr
    (pytest shows it with a failure). Returns 0, the first failing rank's code (128 + signal when killed), or 124
    after `timeout_s`; every rank has ended when it returns."""
    from xstage_dit.comm.launcher import free_port, rank_env

    context, port = _server(), free_port()
    paths = [Path(f"{logs}.{rank}.log") for rank in range(world)]
    procs = [context.Process(target=_run_rank, args=(str(program), list(args), rank_env(rank, world, port, env),
                                                     str(paths[rank])))
             for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        code = _supervise(procs, timeout_s)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for rank, path in enumerate(paths):
            if path.is_file() and path.stat().st_size:
                sys.stderr.write(f"--- rank {rank} ---\n{path.read_text(errors='replace')[-20000:]}")
    return code


def _supervise(procs: list, timeout_s: float) -> int:
    """0, the code of the rank that failed first (exits in the order `wait` reports them: a rank's death makes
    its peers fail right after, and the cause is what a test asserts), or 124 after `timeout_s`."""
    from xstage_dit.comm.launcher import shell_exit_code

    deadline, exits = time.monotonic() + timeout_s, []
    while True:
        ready = multiprocessing.connection.wait([p.sentinel for p in procs if p not in exits], timeout=0.5)
        for p in procs:
            if p.sentinel in ready:
                p.join(5)  # the sentinel closes a moment before the exit code can be read
                exits.append(p)
        failed = [p.exitcode for p in exits if p.exitcode != 0]
        if failed:
            return shell_exit_code(failed[0])
        if len(exits) == len(procs):
            return 0
        if time.monotonic() > deadline:
            return 124
