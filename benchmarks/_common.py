"""Shared helpers of the benchmark scripts: environment record, timing, JSON + Markdown output.

Every result file has the same shape::

    {"benchmark": "flux-step", "environment": {...}, "summary": {...}, "rows": [{...}, ...]}

- ``environment()``: GPU name, driver, CUDA, torch / triton / diffusers / transformers versions, Python,
  host, git commit (``git rev-parse`` or ``$XSTAGE_GIT_COMMIT`` when the tree travels without ``.git``).
- ``time_ms(fn)``: median of per-call CUDA-event timings after warm-up (on a CPU: ``perf_counter``),
  with the spread, so a reader can tell a difference from noise.
- ``write_results(...)``: ``<stem>.json`` and ``<stem>.md`` (a Markdown table of the rows) in one call.

Example::

    stats = time_ms(lambda: model(**inputs), warmup=3, reps=10)
    write_results("benchmarks/results/flux-step-h200", "flux-step", rows, summary, columns)
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch


def git_commit(repo: str | Path | None = None) -> str:
    """``$XSTAGE_GIT_COMMIT`` when set (a tree copied to a GPU machine, whose `.git` there may be stale), else
    the checkout's commit (``-dirty`` when it has changes), else "unknown"."""
    if os.environ.get("XSTAGE_GIT_COMMIT"):
        return os.environ["XSTAGE_GIT_COMMIT"]
    repo = Path(repo or Path(__file__).resolve().parent.parent)
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("XSTAGE_GIT_COMMIT", "unknown")


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except Exception:  # noqa: BLE001 - an optional package missing or broken is recorded as absent
        return None


def _nvidia_smi(query: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
        return out.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def environment(commit: str | None = None) -> dict[str, Any]:
    """Where and with what a benchmark ran (recorded in every result file).

    commit: the commit to record when the caller knows it better than `git_commit()` (a tree copied to a
    GPU machine without its `.git`).
    """
    now = datetime.datetime.now(datetime.timezone.utc)
    env: dict[str, Any] = {
        "time_utc": now.isoformat(timespec="seconds"),
        "date_utc": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "diffusers": _version("diffusers"),
        "transformers": _version("transformers"),
        "git_commit": commit or git_commit(),
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=torch.cuda.get_device_name(0),
            gpu_count=torch.cuda.device_count(),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count,
            driver=_nvidia_smi("driver_version"),
        )
    else:
        env.update(gpu=None, gpu_count=0, driver=None)
    return env


def time_ms(fn: Callable[[], Any], *, warmup: int = 3, reps: int = 10, device: str | torch.device | None = None
            ) -> dict[str, float]:
    """Time ``fn()``: ``warmup`` untimed calls, then ``reps`` calls each timed on its own.

    On CUDA each call sits between two events on the current stream (no host sync inside the loop);
    on a CPU ``perf_counter`` brackets each call. Returns milliseconds: median, min, max, p20, p80, reps.
    """
    if warmup < 0 or reps < 1:
        raise ValueError(f"expected warmup >= 0 and reps >= 1, got {warmup} and {reps}")
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    for _ in range(warmup):
        fn()
    times: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    ordered = sorted(times)

    def quantile(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {
        "median_ms": statistics.median(times),
        "min_ms": ordered[0],
        "max_ms": ordered[-1],
        "p20_ms": quantile(0.2),
        "p80_ms": quantile(0.8),
        "reps": reps,
    }


def interleaved_times(fns: dict[str, Callable[[], Any]], time_fn: Callable[[Callable[[], Any]], float], *,
                      rounds: int = 3) -> dict[str, list[float]]:
    """Time several variants in ``rounds`` interleaved rounds: ``{name: [ms per round]}``.

    Timing variant A to completion and then variant B lets a drift of the GPU over the run (clocks,
    temperature) read as a difference between A and B. Here every round times every variant once
    (``time_fn(fn)`` -> ms, e.g. a median of CUDA events), forward in even rounds and backward in odd
    ones (A B C, C B A, ...): over an even number of rounds a linear drift gives every variant the same
    median over rounds.
    """
    if rounds < 1:
        raise ValueError(f"expected rounds >= 1, got {rounds}")
    names = list(fns)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            out[name].append(float(time_fn(fns[name])))
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return "" if value is None else str(value)


def markdown_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """Rows as a GitHub Markdown table; ``columns`` picks and orders the keys (default: the first row's)."""
    if not rows:
        raise ValueError("expected at least one row, got none")
    columns = list(columns or rows[0].keys())
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_results(stem: str | Path, benchmark: str, rows: Sequence[dict], summary: dict,
                  columns: Sequence[str] | None = None, notes: str = "", env: dict | None = None,
                  table_rows: Sequence[dict] | None = None, extra: dict | None = None) -> tuple[Path, Path]:
    """Write ``<stem>.json`` (environment, summary, rows) and ``<stem>.md`` (environment line, table, notes).

    table_rows: the rows as the table shows them, where a cell reads differently from the JSON value (default:
    ``rows``). extra: more top-level keys of the JSON (e.g. ``provenance``), after the four above.
    """
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    env = env or environment()
    payload = {"benchmark": benchmark, "environment": env, "summary": summary, "rows": list(rows)}
    payload.update({k: v for k, v in (extra or {}).items() if k not in payload})
    # Not with_suffix: a stem may hold a dot of its own (a model folder named FLUX.1-dev).
    json_path = stem.parent / f"{stem.name}.json"
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    who = ", ".join(f"{k} {env.get(k)}" for k in ("gpu", "driver", "torch", "triton", "diffusers") if env.get(k))
    md = [f"# {benchmark}", "", f"{who}; commit {env.get('git_commit')}; {env.get('time_utc')}", "",
          markdown_table(rows if table_rows is None else table_rows, columns)]
    if notes:
        md += [notes.strip(), ""]
    md_path = stem.parent / f"{stem.name}.md"
    md_path.write_text("\n".join(md))
    return json_path, md_path
