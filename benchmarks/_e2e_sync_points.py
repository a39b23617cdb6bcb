"""Where does one pipeline call make the host wait for the GPU? Every synchronizing CUDA operation of a warm call,
by the line that asked for it.

Why: a host-bound call loses twice at each synchronization: the host waits until the GPU's queue drains, then
the GPU idles while the host prepares the next work. NucleusMoE's compiled 4-step call is host-bound (host 610 ms
against 387 ms of GPU work at f6c8114) and torch's profiler counted 100 ``cudaMemcpyAsync`` of 0.5 ms each a
call without saying whose they were (``features.host_syncs`` removed the transformer's four a forward; the rest
were not identified). ``torch.cuda.set_sync_debug_mode("warn")`` makes torch warn at every synchronizing
operation (a copy from pageable host memory to the GPU, a copy back, ``.item()``, ``nonzero``, a stream
synchronize); here each warning's Python stack is kept and the warnings are grouped by the first frame outside
torch (the line that asked), with the nearest frames of diffusers, transformers and xstage_dit for context.

One warm call (after ``--warmup`` calls), the pipeline as the bench's contenders run it: ``xstage`` (parallelize,
batch invariance, ``--compile``) or ``diffusers`` (plain). A CUDA GPU is required (the mode does not exist
without CUDA).

    python benchmarks/bench_e2e.py sync-points --model full-nucleusmoe --steps 4 --compile regional

Writes <out-dir>/sync-points-<model>-<variant>-<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

from benchmarks._common import environment, write_results

PROMPT = "a red fox in the snow"
SYNC_MESSAGE = "synchronizing CUDA operation"  # torch's sync-debug warning text
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_CONTEXT = ("diffusers", "transformers", "xstage_dit")


@contextlib.contextmanager
def captured_warnings(match: str):
    """Yields a list that receives the Python stack (``traceback.FrameSummary`` list, outermost first, this
    module's frames and the warnings machinery dropped) of every warning whose message contains `match`, each
    occurrence (not once per location). Other warnings go to the previous handler."""
    stacks: list[list[traceback.FrameSummary]] = []
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if match in str(message):
            stack = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith(("warnings.py",))]
            stacks.append(stack)
        else:
            previous(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        yield stacks


def asker(stack: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame outside torch's own files: the line whose call reached the synchronizing op."""
    for frame in reversed(stack):
        if not frame.filename.startswith(_TORCH_DIR) and frame.filename != __file__:
            return frame
    return None


def _where(frame: traceback.FrameSummary | None) -> str:
    if frame is None:
        return "(inside torch)"
    name = frame.filename
    for package in _CONTEXT:
        marker = os.sep + package + os.sep
        if marker in name:
            name = package + os.sep + name.split(marker, 1)[1]
            break
    return f"{name}:{frame.lineno} {frame.name}"


def group_sync_points(stacks: list[list[traceback.FrameSummary]], context: int = 3) -> list[dict]:
    """Counts per asking line, most first: ``{"where", "count", "line", "context"}``; context: the next
    `context` frames outward in diffusers / transformers / xstage_dit (who called the asking function)."""
    counts: Counter = Counter()
    detail: dict[str, dict] = {}
    for stack in stacks:
        frame = asker(stack)
        where = _where(frame)
        counts[where] += 1
        if where not in detail:
            index = stack.index(frame) if frame is not None else len(stack)
            outer = [_where(f) for f in reversed(stack[:index])
                     if any(os.sep + p + os.sep in f.filename for p in _CONTEXT)][:context]
            detail[where] = {"line": (frame.line or "").strip() if frame is not None else "", "context": outer}
    return [{"where": where, "count": count, **detail[where]} for where, count in counts.most_common()]


def main(argv=None) -> int:
    from xstage_dit.features.compile import COMPILE_MODES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="full-nucleusmoe")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--variant", default="xstage", choices=("xstage", "diffusers"))
    p.add_argument("--compile", default="regional", choices=COMPILE_MODES, help="xstage variant only")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (compile, first-touch caches)")
    p.add_argument("--out-dir", default="benchmarks/results/serving")
    p.add_argument("--tag", default="h200")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("expected a CUDA GPU: torch.cuda.set_sync_debug_mode needs one")
    from xstage_dit.families import load_pipeline, model_spec
    from xstage_dit.runtime.generation import call_kwargs, run_pipeline

    device = torch.device("cuda")
    spec = model_spec(args.model)
    pipe = load_pipeline(args.model, dtype=torch.bfloat16, device=device, seed=0)
    pipe.set_progress_bar_config(disable=True)
    if args.variant == "xstage":
        from xstage_dit.features import ParallelConfig, parallelize
        from xstage_dit.features.batch_invariance import batch_invariant_for
        from xstage_dit.features.compile import apply_compile

        parallelize(pipe, ParallelConfig(schedule="auto", calibrate=True))
        batch_invariant_for(pipe, spec.kind)
        apply_compile(pipe, args.compile)

    def call():
        run_pipeline(pipe, **call_kwargs(pipe, spec, prompt=PROMPT, seed=1, steps=args.steps))

    for _ in range(args.warmup):
        call()
    torch.cuda.synchronize()
    with captured_warnings(SYNC_MESSAGE) as stacks:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    rows = group_sync_points(stacks)
    summary = {"model": args.model, "variant": args.variant, "compile": args.compile if args.variant == "xstage" else
               "off", "steps": args.steps, "sync_points": len(stacks), "asking_lines": len(rows)}
    print(f"{len(stacks)} synchronizing operations from {len(rows)} lines", flush=True)
    for row in rows[:20]:
        print(f"{row['count']:5d}  {row['where']}  <- {' <- '.join(row['context'])}", flush=True)
    stem = Path(args.out_dir) / f"sync-points-{args.model}-{args.variant}-{args.tag}"
    write_results(str(stem), "sync-points", rows, summary, ["count", "where", "line", "context"], env=environment())
    return 0

