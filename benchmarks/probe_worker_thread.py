"""Does a pipeline call run slower from a worker thread than from the main thread? (issue 15: NucleusMoE's served
call measured 1.20x the bare call at 737c715, its transformer steps 99.7 vs 86.3 ms, on the H200)

The server runs every pipeline call on its worker thread; the bench's bare contender calls from the main
thread. This times the same patched (and optionally compiled) pipeline both ways, and with torch's CPU
intra-op pool at one thread (an OpenMP team made for a second thread competes with the first for the cores
that launch the GPU's kernels):

    python benchmarks/probe_worker_thread.py --model full-nucleusmoe --steps 4 --compile regional

Writes <out-dir>/worker-thread-<model>.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, when run as a script

from benchmarks._common import environment, write_results  # noqa: E402
from xstage_dit.features.compile import COMPILE_MODES  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="full-nucleusmoe")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--compile", default="regional", choices=COMPILE_MODES)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--out-dir", default="benchmarks/results/serving")
    args = p.parse_args(argv)
    from xstage_dit.families import load_pipeline, model_spec
    from xstage_dit.runtime.generation import call_kwargs, run_pipeline
    from xstage_dit.features import ParallelConfig, parallelize
    from xstage_dit.features.compile import apply_compile

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = model_spec(args.model)
    pipe = load_pipeline(args.model, dtype=dtype, device=device, seed=0)
    pipe.set_progress_bar_config(disable=True)
    handle = parallelize(pipe, ParallelConfig(schedule="auto", calibrate=True))
    compiled = apply_compile(pipe, args.compile)

    def one_call() -> float:
        t0 = time.perf_counter()
        run_pipeline(pipe, **call_kwargs(pipe, spec, prompt="a red fox in the snow", seed=1, steps=args.steps))
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(2):
        one_call()  # compile, caches, both threads' first touch below are timed after their own warm call

    def timed(label: str, in_thread: bool, threads: int | None) -> dict:
        saved = torch.get_num_threads()
        box: dict = {}

        def body():
            if threads is not None:
                torch.set_num_threads(threads)
            one_call()
            box["s"] = [one_call() for _ in range(args.reps)]

        try:
            if in_thread:
                t = threading.Thread(target=body)
                t.start()
                t.join()
            else:
                body()
        finally:
            torch.set_num_threads(saved)
        s = box["s"]
        row = {"how": label, "median_s": round(statistics.median(s), 4), "min_s": round(min(s), 4),
               "max_s": round(max(s), 4), "torch_threads": threads or saved}
        print(row, flush=True)
        return row

    rows = []
    for _ in range(2):  # two interleaved rounds
        rows.append(timed("main thread", False, None))
        rows.append(timed("worker thread", True, None))
        rows.append(timed("worker thread, torch CPU threads 1", True, 1))
        rows.append(timed("main thread, torch CPU threads 1", False, 1))
    compiled.restore()
    handle.restore()
    summary = {"cpu_count": os.cpu_count(), "sched_affinity": len(os.sched_getaffinity(0)),
               "torch_threads": torch.get_num_threads(), "model": args.model, "steps": args.steps,
               "compile": args.compile}
    out = Path(args.out_dir) / f"worker-thread-{args.model}"
    write_results(out, "worker-thread", rows, summary, ("how", "median_s", "min_s", "max_s", "torch_threads"),
                  notes="Wall time of one pipeline call (synchronized), median of --reps calls after one warm call "
                        "per thread; two interleaved rounds.", env=environment())
    return 0


if __name__ == "__main__":
    sys.exit(main())
