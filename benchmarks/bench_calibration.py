"""Calibration benchmark: full calibration per target, quick-calibration and cache-load times, plots.

    python benchmarks/bench_calibration.py --out OUT [--prefix calibration-h200-1gpu] [--targets local,host]
                                           [--peer-shared-gpu]

Writes ``<prefix>.json`` (top-level ``summary``: per target R_GBps, t_iss0_us, Q_MiB, mape_issue_pct,
mape_period_pct, drain_limited; quick_calibration_s; cache_load_ms), ``<prefix>.md`` and the four PNGs.
The quick calibration is timed in a fresh process (the server's start-up: CUDA context up, build
cached), then the cache load in that process. ``--peer-shared-gpu`` adds a quick sweep of the peer
path with two processes sharing this GPU: a functional run of the NVLink code, NOT an NVLink number.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUICK_SNIPPET = r"""
import json, sys, tempfile, time
import torch
torch.cuda.init(); torch.empty(1, device="cuda"); torch.cuda.synchronize()
from xstage_dit.calibration.runner import load_or_calibrate
cache = tempfile.mkdtemp()
t0 = time.perf_counter()
res = load_or_calibrate(quick=True, target=sys.argv[1], cache_dir=cache, force=True)
quick_s = time.perf_counter() - t0
loads = []
for _ in range(5):
    t0 = time.perf_counter()
    again = load_or_calibrate(quick=True, target=sys.argv[1], cache_dir=cache)
    loads.append(time.perf_counter() - t0)
    assert again.source == "cache" and again.params == res.params
print("QUICK_JSON " + json.dumps({"quick_calibration_s": quick_s, "cache_load_ms": sorted(loads)[2] * 1e3,
      "cache_load_first_ms": loads[0] * 1e3, "quick_summary": res.summary()}))
"""


def env_info() -> dict:
    from benchmarks._common import environment
    from xstage_dit.calibration import machine_key

    info = environment()
    info["machine_key"] = machine_key()
    info["driver"] = info["machine_key"].get("driver") or info["driver"]
    return info


def markdown(summary: dict, info: dict, prefix: str) -> str:
    lines = [f"# {prefix}", "",
             f"{info['gpu']}, driver {info['driver']}, torch {info['torch']}, triton {info['triton']}, "
             f"commit {info['git_commit']}, {info['date_utc']}", "",
             "| target | R (GB/s) | T_iss0 (us) @ V | Q (MiB) | MAPE issue (%) | MAPE period (%) | issue err / period (%) | drain-limited |",
             "|---|---|---|---|---|---|---|---|"]
    for t, s in summary.items():
        if not isinstance(s, dict) or "drain_limited" not in s:
            continue
        r = f"{s['R_GBps']:.1f}" if s["R_GBps"] is not None else f">= {s.get('R_lower_bound_GBps', 0):.0f} (never backs up)"
        q = f"{s['Q_MiB']:.2f}" if s["Q_MiB"] is not None else "not observed"
        lines.append(f"| {t} | {r} | {s['t_iss0_us']:.3f} @ {s['t_iss0_volume_bytes'] / 2**20:.1f} MiB | {q} | "
                     f"{s['mape_issue_pct']:.2f} | {s['mape_period_pct']:.2f} | {s.get('issue_err_over_period_pct', float('nan')):.2f} | "
                     f"{s['drain_limited']} |")
    lines += ["", f"quick calibration: {summary.get('quick_calibration_s')} s; cache load: {summary.get('cache_load_ms')} ms"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefix", default="calibration-h200-1gpu")
    ap.add_argument("--targets", default="local,host")
    ap.add_argument("--peer-shared-gpu", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from xstage_dit.calibration.runner import CalibrationConfig, run_calibration
    from xstage_dit.cli.calibrate import draw_plots, format_table

    doc: dict = {"summary": {}}
    # 1. quick calibration + cache load, in a fresh process
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", QUICK_SNIPPET, args.targets], capture_output=True, text=True,
                          env=env, timeout=120)
    wall = time.perf_counter() - t0
    quick = None
    for line in proc.stdout.splitlines():
        if line.startswith("QUICK_JSON "):
            quick = json.loads(line[len("QUICK_JSON "):])
    if quick is None:
        print(proc.stdout[-4000:], proc.stderr[-4000:])
        doc["quick_error"] = proc.stderr[-4000:]
    else:
        quick["process_wall_s"] = wall
        doc["quick_timing"] = quick
        print(f"quick calibration {quick['quick_calibration_s']:.2f} s, cache load {quick['cache_load_ms']:.2f} ms "
              f"(first {quick['cache_load_first_ms']:.2f} ms), process wall {wall:.1f} s")

    # 2. full calibration, in-process
    info = env_info()
    res = None
    for name in args.targets.split(","):  # one target failing keeps the others
        try:
            one = run_calibration(None, CalibrationConfig(target=name, quick=False))
        except Exception as exc:
            doc.setdefault("errors", {})[name] = repr(exc)[-3000:]
            print(f"full calibration of {name} failed: {exc!r}")
            continue
        if res is None:
            res = one
        else:
            res.params.update(one.params)
            res.reports.update(one.reports)
            res.elapsed_s += one.elapsed_s
    if res is None:
        (out / f"{args.prefix}.json").write_text(json.dumps(doc, indent=1, default=float))
        return 1
    print(format_table(res))
    doc.update(env=info, full_calibration_s=res.elapsed_s, **res.to_json())
    doc["summary"].update(res.summary())
    if quick is not None:
        doc["summary"]["quick_calibration_s"] = quick["quick_calibration_s"]
        doc["summary"]["cache_load_ms"] = quick["cache_load_ms"]
    for p in draw_plots(res, out, args.prefix):
        print(f"wrote {p}")

    # 3. the peer path, two processes sharing this GPU (functional; not NVLink)
    if args.peer_shared_gpu:
        try:
            peer = run_calibration(None, CalibrationConfig(target="nvlink", quick=True, allow_shared_gpu=True))
            rep = peer.reports["nvlink"]
            doc["peer_shared_gpu"] = {"note": "two processes sharing ONE GPU through torch symmetric memory: the "
                                              "nvlink code path, stores land in the same HBM; not an NVLink measurement",
                                      "summary": rep["summary"], "fit": rep["fit"], "validation": rep["validation"],
                                      "notes": rep["notes"], "elapsed_s": peer.elapsed_s}
            print("peer (shared GPU):", json.dumps(rep["summary"]))
        except Exception as exc:  # keep the main results
            doc["peer_shared_gpu"] = {"error": repr(exc)[-3000:]}
            print("peer (shared GPU) failed:", repr(exc)[-3000:])
    doc["summary"]["nvlink"] = ("not measured: no multi-GPU machine was lent (the peer path ran with two processes "
                                "sharing one GPU, see peer_shared_gpu)")
    (out / f"{args.prefix}.json").write_text(json.dumps(doc, indent=1, default=float))
    (out / f"{args.prefix}.md").write_text(markdown(doc["summary"], info, args.prefix))
    print(json.dumps(doc["summary"], indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
