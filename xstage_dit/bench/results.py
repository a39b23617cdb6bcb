"""The shared shape of every benchmark result: ``<stem>.json`` (benchmark, environment, summary, rows) and
``<stem>.md`` (a Markdown table), with the environment a run happened in. Inside the package so that
``xstage-dit bench`` works from an installed wheel; ``benchmarks/_common.py`` re-exports it for the scripts.

- ``environment()``: GPU name, driver, CUDA, torch / triton / diffusers / transformers versions, Python,
  host, git commit (``git rev-parse`` or ``$XSTAGE_GIT_COMMIT`` when the tree travels without ``.git``).
- ``write_results(...)``: ``<stem>.json`` and ``<stem>.md`` in one call.

Example::

    write_results("benchmarks/results/flux-step-h200", "flux-step", rows, summary, columns)
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Sequence

import torch

# The checkout this package sits in (a wheel's site-packages has no .git: the commit is then "unknown").
_CHECKOUT = Path(__file__).resolve().parents[2]


def git_commit(repo: str | Path | None = None) -> str:
    """``$XSTAGE_GIT_COMMIT`` when set (a tree copied to a GPU machine, whose `.git` there may be stale), else
    the checkout's commit (``-dirty`` when it has changes), else "unknown"."""
    if os.environ.get("XSTAGE_GIT_COMMIT"):
        return os.environ["XSTAGE_GIT_COMMIT"]
    repo = Path(repo or _CHECKOUT)
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
