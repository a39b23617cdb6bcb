"""GPU check of issue 18 (marked `gpu`: skipped, and counted, without a CUDA device): the tiny pipelines
of tests/features/test_families.py in bf16, two processes sharing the GPU (gloo control) against the
single-process pipeline each rank runs itself first. bf16 through every step and the VAE: compared
by the mean and the largest pixel difference (pixels in [0, 1]), printed per family (``pytest -s``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "features" / "_families_worker.py")
sys.path.insert(0, str(ROOT / "tests" / "features"))
from test_families import FAMILIES  # noqa: E402

MAX_ABS, MEAN_ABS = 0.1, 0.01  # bf16 kernels differ between the sharded and the whole attention


@pytest.mark.gpu
def test_family_pipelines_two_ranks_sharing_the_gpu_bf16(tmp_path):
    from xstage_dit.comm.launcher import launch

    out = tmp_path / "gpu.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               XSTAGE_TEST_DEVICE="cuda", XSTAGE_TEST_DTYPE="bfloat16", XSTAGE_TEST_TIMEOUT="300")
    assert launch(2, [sys.executable, WORKER, str(out), *FAMILIES], timeout_s=900, env=env) == 0
    results = json.loads(Path(f"{out}.0").read_text())
    for name in FAMILIES:
        r = results[name]
        print(f"gpu bf16 world 2 {name}: max abs {r['max_abs_parallel']:.3e}, mean abs {r['mean_abs_parallel']:.3e}")
        assert r["finite"] and r["ref_std"] > 1e-3, (name, r)
        assert r["max_abs_parallel"] <= MAX_ABS and r["mean_abs_parallel"] <= MEAN_ABS, (name, r)
        assert r["tokens_parallel"] < r["tokens_single"], (name, r)
