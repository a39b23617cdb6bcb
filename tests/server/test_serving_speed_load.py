"""benchmarks/bench_serving.py on the tiny model (CPU): every (size, concurrency, policy) measured, the
batcher's warm-up decision recorded, verdicts FIFO vs batched, JSON + Markdown written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_load_test_script_on_tiny_flux(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_serving.py"), "--model", "tiny-flux",
                           "--sizes", "64x64,32x32", "--concurrency", "1,3", "--steps", "2", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "serving-tiny-flux-1xcpu.json").read_text())
    rows = record["rows"]
    assert {(r["size"], r["concurrency"], r["policy"]) for r in rows} == {
        (s, c, p) for s in ("64x64", "32x32") for c in (1, 3) for p in ("never", "always")}
    assert all(r["status"] == "ok" and r["mean_s"] > 0 and r["p95_s"] >= r["mean_s"] * 0.5 for r in rows), rows
    assert all(r["max_batch"] == 1 for r in rows if r["policy"] == "never")
    assert any(r["max_batch"] > 1 for r in rows if r["policy"] == "always" and r["concurrency"] == 3)
    summary = record["summary"]
    assert set(summary["auto"]["sizes"]) >= {"64x64", "32x32"}  # measured at warm-up
    assert len(summary["verdicts"]) == 4 and all(v["auto_picked"] in ("never", "always") for v in summary["verdicts"])
    assert "FIFO mean" in (tmp_path / "serving-tiny-flux-1xcpu.md").read_text()
