"""The step cache on several ranks (gloo, CPU): one decision for all ranks.

- A fixed schedule (a full step every 2nd step) gives one process's image at world 2 and 4, under sequence
  parallelism and CFG parallel, for First Block Cache, TaylorSeer and MagCache on tiny FLUX, Wan and Qwen-Image,
  and every rank counts the same computed and skipped steps.
- First Block Cache's measured decision is the whole image's: at a threshold away from every measured change, the
  ranks take one process's decisions, step by step.
- Disagreeing shards (each rank's own sums forced): a rank whose change alone would skip computes when the group
  says compute, and one whose change alone would compute skips when the group says skip; nothing hangs. The same
  with real tensors through the gate, a rank of the uncond branch following the cond rank's change.

This file is also the rank program (``python tests/features/test_step_cache_ranks.py OUT WORLD``, started by
`tests.helpers.family_harness.launch_ranks`): every rank computes the one-process references itself, then the
parallel runs; each writes ``OUT.<rank>``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers.family_harness import launch_ranks  # noqa: E402
from tests.helpers.step_cache_cases import CALLS, CFG_MODELS, image, pipeline  # noqa: E402
from tests.helpers.tolerances import TOL  # noqa: E402

STEPS = 5
SCHEDULED = ("fbcache", "taylorseer", "magcache")
CONFIGS = {2: {"sp2": dict(sp=2), "cfg2": dict(cfg=2)}, 4: {"sp4": dict(sp=4), "sp2-cfg2": dict(sp=2, cfg=2)}}


def _run(pipe, model: str, cache, parallel=None, **extra):
    from xstage_dit.features import apply_stack
    from xstage_dit.features.stack import StackConfig
    from xstage_dit.features.step_cache import cache_request

    stack = apply_stack(pipe, StackConfig(parallel=parallel, cache=cache))
    try:
        with cache_request(pipe, steps=STEPS) as run:
            out = image(pipe, model, steps=STEPS, **extra)
    finally:
        stack.restore()
    return out, run.stats


class Trace:
    """The gate's decision of each step and its measured changes, recorded (test code: the gate carries no
    instrumentation)."""

    def __init__(self, monkey):
        from xstage_dit.features.step_cache import StepGate

        self.decisions: list = []
        self.changes: list = []
        decide, measured = StepGate.decide, StepGate._measured

        def traced_decide(gate, context, residual, previous):
            step = gate.step
            out = decide(gate, context, residual, previous)
            if gate.step > step:  # a step's decision (not an uncond call taking its rank's cond decision)
                self.decisions.append(out)
            return out

        def traced_measured(gate, sums):
            if gate.world > 1:
                from xstage_dit.comm.staged import all_gather_dim0

                total = all_gather_dim0(sums[None], gate.group).sum(dim=0)
            else:
                total = sums
            change, reference, _ = total.tolist()
            self.changes.append(change / reference if reference > 0 else float("inf"))
            return measured(gate, sums)

        monkey.setattr(StepGate, "decide", traced_decide)
        monkey.setattr(StepGate, "_measured", traced_measured)


def _threshold(changes: list[float]) -> float:
    """A threshold in the middle of the widest gap between measured changes (far from each, in ratio)."""
    values = sorted(c for c in changes if np.isfinite(c) and c > 0)
    lo, hi = max(zip(values, values[1:]), key=lambda pair: pair[1] / pair[0])
    return float(np.sqrt(lo * hi))


def _equivalence(results: dict, pipe, model: str, world: int) -> None:
    from xstage_dit.features import ParallelConfig
    from xstage_dit.features.step_cache import StepCacheConfig

    configs = {n: c for n, c in CONFIGS[world].items() if "cfg" not in c or model in CFG_MODELS}
    for method in SCHEDULED:
        cache = StepCacheConfig(method, compute_every=2)
        ref, ref_stats = _run(pipe, model, cache)
        for name, config in configs.items():
            out, stats = _run(pipe, model, cache, ParallelConfig(**config))
            results[f"{model}/{method}/{name}"] = {"max_abs": float(np.abs(out - ref).max()), "stats": stats,
                                                   "ref_stats": ref_stats, "ref_std": float(ref.std())}


def _measured(results: dict, pipe, model: str, world: int) -> None:
    """fbcache at a threshold away from every change one process measured: the same decisions on every rank."""
    from xstage_dit.features import ParallelConfig
    from xstage_dit.features.step_cache import StepCacheConfig

    with pytest.MonkeyPatch.context() as monkey:
        trace = Trace(monkey)
        _run(pipe, model, StepCacheConfig("fbcache", threshold=0.0))  # every step measured, none skipped
        threshold = _threshold(trace.changes)
        trace.decisions.clear(), trace.changes.clear()
        ref, ref_stats = _run(pipe, model, StepCacheConfig("fbcache", threshold=threshold))
        ref_decisions, ref_changes = list(trace.decisions), list(trace.changes)
        config = dict(sp=world) if model not in CFG_MODELS else dict(sp=world // 2, cfg=2)
        trace.decisions.clear(), trace.changes.clear()
        out, stats = _run(pipe, model, StepCacheConfig("fbcache", threshold=threshold), ParallelConfig(**config))
    results[f"{model}/measured"] = {
        "threshold": threshold, "margin": min(abs(np.log(c / threshold)) for c in ref_changes if c > 0),
        "ref_stats": ref_stats, "stats": stats, "ref_decisions": ref_decisions, "decisions": trace.decisions,
        "max_abs": float(np.abs(out - ref).max())}


def _forced_disagreement(results: dict, pipe, rank: int) -> None:
    """Each rank's sums forced (threshold 1): rank 0's alone would skip, rank 1's compute, the group computes;
    then rank 1's alone would compute, rank 0's (a large reference) pulls the group under the threshold: skip."""
    from xstage_dit.features import ParallelConfig
    from xstage_dit.features.step_cache import StepCacheConfig, StepGate

    model, cache = "tiny-flux", StepCacheConfig("fbcache", threshold=1.0)
    plain = image(pipe, model, steps=STEPS)
    cases = {"group-computes": [(0.0, 1.0), (10.0, 1.0)], "group-skips": [(0.0, 100.0), (2.0, 1.0)]}
    for name, sums in cases.items():
        forced = torch.tensor([*sums[rank], 0.0], dtype=torch.float64)
        with pytest.MonkeyPatch.context() as monkey:
            monkey.setattr(StepGate, "_sums", staticmethod(lambda context, residual, previous: forced.clone()))
            out, stats = _run(pipe, model, cache, ParallelConfig(sp=2))
        results[f"forced/{name}"] = {"stats": stats, "alone_says_compute": sums[rank][0] / sums[rank][1] >= 1.0,
                                     "uncached_max_abs": float(np.abs(out - plain).max())}


def _gate_with_tensors(results: dict, rank: int) -> None:
    """The gate on real shards: rank 0's shard changed by 2 %, rank 1's by 60 % (threshold 0.1). Then a cond rank
    and an uncond rank: the uncond rank follows the cond rank's change, its own ignored."""
    import torch.distributed as dist

    from xstage_dit.features.step_cache import StepGate

    previous = torch.ones(1, 8, 4)
    gate = StepGate(world=2, group=dist.group.WORLD, threshold=0.1)
    shard = previous * (1.02 if rank == 0 else 1.6)
    results["gate/shards"] = [gate.decide("cond", shard, None), gate.decide("cond", shard, previous)]
    gate.begin()
    context, change = ("cond", 1.05) if rank == 0 else ("uncond", 3.0)
    results["gate/branches"] = [gate.decide(context, previous * change, None),
                                gate.decide(context, previous * change, previous)]


def rank_main(out: str, world: int) -> int:
    from xstage_dit.comm.distributed import close_distributed, init_distributed

    info = init_distributed(backend="gloo", timeout_s=300)
    torch.set_num_threads(1)
    results: dict = {}
    for model in CALLS:
        pipe = pipeline(model)
        _equivalence(results, pipe, model, world)
        _measured(results, pipe, model, world)
        if world == 2 and model == "tiny-flux":
            _forced_disagreement(results, pipe, info.rank)
    if world == 2:
        _gate_with_tensors(results, info.rank)
    Path(f"{out}.{info.rank}").write_text(json.dumps(results))
    close_distributed()
    return 0


# ------------------------------------------------------------------------------------------------------- tests


# world 4 (four ranks on the 2-core machine) took 28 s: `slow`; world 2 took 17 s
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)])
def ranks(request, tmp_path_factory):
    return request.param, launch_ranks(__file__, "step-cache", request.param, tmp_path_factory.mktemp("ranks"))


def test_a_fixed_schedule_gives_one_process_image_on_every_rank(ranks):
    world, results = ranks
    checked = 0
    for rank, got in enumerate(results):
        for key, r in got.items():
            if key.count("/") != 2 or key.startswith(("forced", "gate")):
                continue
            checked += 1
            assert r["stats"] == r["ref_stats"] and r["stats"]["skipped"] == STEPS // 2, (rank, key, r)
            assert r["ref_std"] > 1e-3 and r["max_abs"] <= TOL.fp32_pipeline, (rank, key, r)
    # per rank: 3 methods x (FLUX under sp; Wan and Qwen-Image under sp and under cfg)
    assert checked == world * 3 * (1 + 2 + 2)


def test_the_measured_decision_is_the_whole_image_and_one_process(ranks):
    world, results = ranks
    for model in CALLS:
        first = results[0][f"{model}/measured"]
        assert first["margin"] > 1e-3, first  # the threshold sits away from every measured change
        assert 0 < first["ref_stats"]["skipped"] < STEPS, first  # it decides: some steps skipped, some not
        for rank, got in enumerate(results):
            r = got[f"{model}/measured"]
            assert r["stats"] == r["ref_stats"], (rank, model, r)
            assert r["max_abs"] <= TOL.fp32_pipeline, (rank, model, r)
            assert r["decisions"] == r["ref_decisions"], (rank, model, r)  # step by step, on every rank


def test_disagreeing_shards_follow_the_group(ranks):
    world, results = ranks
    if world != 2:
        pytest.skip("the forced cases run at world 2")
    assert [results[r]["forced/group-computes"]["alone_says_compute"] for r in (0, 1)] == [False, True]
    assert [results[r]["forced/group-skips"]["alone_says_compute"] for r in (0, 1)] == [False, True]
    for rank in (0, 1):
        computes, skips = results[rank]["forced/group-computes"], results[rank]["forced/group-skips"]
        assert computes["stats"]["skipped"] == 0 and computes["uncached_max_abs"] <= TOL.fp32_pipeline, computes
        assert skips["stats"]["computed"] == 1 and skips["stats"]["skipped"] == STEPS - 1, skips
        assert results[rank]["gate/shards"] == [True, True]  # 2 % and 60 %: 31 % >= 10 %, computed on both
        assert results[rank]["gate/branches"] == [True, False]  # the cond rank's 5 % < 10 %: both skip


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1], int(sys.argv[2])))
