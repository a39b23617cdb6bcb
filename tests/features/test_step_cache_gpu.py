"""GPU check of the step cache (marked `gpu`: skipped, and counted, without a CUDA device): two processes at
sp = 2 (sharing one GPU over gloo, or one GPU each over NCCL) run tiny FLUX and Wan in bf16 with a cache on, eager
and compiled (regional, Inductor), against the one-process pipeline each rank runs itself first: the same
computed and skipped steps on every rank, the image within bf16's difference between sharded and whole attention,
and a second request with more steps compiles nothing. Printed per case (``pytest -s``).

This file is also the rank program (``python tests/features/test_step_cache_gpu.py OUT``, two ranks).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

MAX_ABS, MEAN_ABS = 0.1, 0.01  # bf16 kernels differ between the sharded and the whole attention
STEPS = 6
CASES = {"fbcache": dict(method="fbcache", compute_every=2), "taylorseer": dict(method="taylorseer", compute_every=2),
         "magcache": dict(method="magcache", compute_every=3)}


def _run(pipe, model, cache, parallel, compile_mode: str, steps: int = STEPS):
    from xstage_dit.features import apply_stack
    from xstage_dit.features.compile import CompileConfig
    from xstage_dit.features.stack import StackConfig
    from xstage_dit.features.step_cache import cache_request
    from tests.helpers.step_cache_cases import image

    stack = apply_stack(pipe, StackConfig(parallel=parallel, cache=cache, compile=CompileConfig(compile_mode)))
    try:
        outs = []
        for n in (steps, steps + 2):  # the second request: more steps, nothing new to compile
            before = _frames()
            with cache_request(pipe, steps=n) as run:
                out = image(pipe, model, steps=n)
            outs.append((out, run.stats, _frames() - before))
    finally:
        stack.restore()
    return outs


def _frames() -> int:
    from xstage_dit import _torch_private as tp

    return tp.frames_converted()


def rank_main(out: str) -> int:
    from xstage_dit.comm.distributed import close_distributed, init_distributed
    from xstage_dit.features import ParallelConfig
    from xstage_dit.features.step_cache import StepCacheConfig
    from tests.helpers.step_cache_cases import pipeline

    info = init_distributed(timeout_s=600)
    results = {}
    for model in ("tiny-flux", "tiny-wan"):
        pipe = pipeline(model, dtype=torch.bfloat16, device=str(info.device))
        for name, case in CASES.items():
            cache = StepCacheConfig(**case)
            for mode in ("off", "regional"):
                ref = _run(pipe, model, cache, None, mode)
                par = _run(pipe, model, cache, ParallelConfig(sp=2), mode)
                results[f"{model}/{name}/{mode}"] = {
                    "max_abs": float(np.abs(par[0][0] - ref[0][0]).max()),
                    "mean_abs": float(np.abs(par[0][0] - ref[0][0]).mean()), "finite": bool(np.isfinite(par[0][0]).all()),
                    "ref_std": float(ref[0][0].std()), "stats": [p[1] for p in par], "ref_stats": [r[1] for r in ref],
                    "later_compiles": par[1][2]}
    Path(f"{out}.{info.rank}").write_text(json.dumps(results))
    close_distributed()
    return 0


@pytest.mark.gpu
def test_two_ranks_with_a_step_cache_equal_one_process_bf16(tmp_path):
    from xstage_dit.comm.launcher import launch

    out = tmp_path / "gpu-cache.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    assert launch(2, [sys.executable, __file__, str(out)], timeout_s=1500, env=env) == 0
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    for key, r in ranks[0].items():
        print(f"gpu bf16 sp=2 {key}: max abs {r['max_abs']:.3e}, mean abs {r['mean_abs']:.3e}, {r['stats'][0]}")
        assert r["finite"] and r["ref_std"] > 1e-3, (key, r)
        assert r["max_abs"] <= MAX_ABS and r["mean_abs"] <= MEAN_ABS, (key, r)
        assert r["stats"] == r["ref_stats"] == ranks[1][key]["stats"] and r["stats"][0]["skipped"] > 0, (key, r)
        assert r["later_compiles"] == 0, (key, r)


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1]))
