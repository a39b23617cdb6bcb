"""Smoke test of benchmarks/bench_moe_combine.py on the CPU: tiny shapes, Triton interpreter, fp16 (the
interpreter's bf16 dot is broken), a stub timer. Checks that every variant runs, is checked against the
unfused path and lands in the summary; timings are meaningless here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1] + "/benchmarks")
import bench_moe_combine as B
from xstage_dit.ops.moe import MoEKernelConfig
B.DEVICE, B.DTYPE = "cpu", torch.float16
n = {"calls": 0}
def stub(fn):
    fn(); n["calls"] += 1
    return 1.0 + 0.01 * n["calls"]
B.bench_ms = stub
shape = dict(hidden=32, inter=48, experts=4, tokens=32, capacity_factor=2.0, top_k=None)
cfgs = {"a": MoEKernelConfig(16, 16, 16, 16, 4, 1), "b": MoEKernelConfig(32, 16, 32, 16, 4, 1),
        "c": MoEKernelConfig(16, 16, 16, 16, 4, 1, use_desc=True)}
res = B.run_shape("nucleusmoe", shape, [1, 2], [0, 1], cfgs, lambda m: None, B.Budget(600), 1)
print("RESULTS " + json.dumps({"results": res, "summary": B.summarize(res)}))
"""


def test_bench_script_runs_every_variant_on_cpu():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT)], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")][-1][len("RESULTS "):])
    res = out["results"]
    assert not [r for r in res if "error" in r], [r for r in res if "error" in r]
    fused = [r for r in res if r["variant"].startswith("fused/")]
    # P=1: 3 configs x 2 leads; P=2: the best config only (top_configs=1) x 2 leads.
    assert len(fused) == 8, [r["variant"] for r in fused]
    assert all(r["rel_err_vs_reference"] < 1e-2 for r in fused)
    s = out["summary"]
    assert set(s["interleaved_over_wave"]) == {"nucleusmoe/P=1", "nucleusmoe/P=2"}
    assert "fused_over_reference" in s and s["speedup_over_serial"] is None


def test_the_world1_bench_tells_a_repeatable_layer_from_one_that_is_not():
    """bench_moe_world1's ``repeats`` column: a deterministic call repeats bit for bit; a scatter-add whose summation
    order changes between calls (as atomics on CUDA do) shows its last-bit difference."""
    import torch

    from benchmarks.bench_moe_world1 import repeat_check

    gen = torch.Generator().manual_seed(0)
    magnitudes = 10.0 ** torch.randint(-3, 8, (64, 1), generator=gen)  # fp32 sums that depend on their order
    values, index = torch.randn(64, 8, generator=gen) * magnitudes, torch.randint(0, 4, (64,), generator=gen)
    assert repeat_check(lambda: torch.zeros(4, 8).index_add_(0, index, values)) == {"repeats": True,
                                                                                  "repeat_max_abs": 0.0}
    calls = iter(range(1000))

    def reordered():  # the same sum, in another order each call
        order = torch.randperm(64, generator=torch.Generator().manual_seed(next(calls)))
        return torch.zeros(4, 8).index_add_(0, index[order], values[order])

    result = repeat_check(reordered)
    assert result["repeats"] is False and result["repeat_max_abs"] > 0, result
