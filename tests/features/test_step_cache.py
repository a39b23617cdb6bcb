"""The step cache at world 1 (`xstage_dit.features.step_cache`): diffusers' own cache hooks on tiny FLUX, Wan and
Qwen-Image. A cache that never skips gives the uncached image bit for bit; a forced schedule skips what it says
and counts it; state never leaks from one request to the next (a cancelled one included); the group decision's
rules (cond leads, a CFG batch measures its cond half, threshold 0 never skips); compile traces no hook (no
recompile per step, the same image as eager); and the refusals, each naming its reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xstage_dit import _torch_private as tp
from xstage_dit.features import apply_stack
from xstage_dit.features.context import PAIR_CONTEXT
from xstage_dit.features.compile import CompileConfig
from xstage_dit.features.stack import StackConfig
from xstage_dit.features.step_cache import StepCacheConfig, StepGate, cache_request, handle_of
from tests.helpers.server import one_torch_thread
from tests.helpers.step_cache_cases import CALLS, image, pipeline

MODELS = tuple(CALLS)
# What never skips, per method: fbcache at threshold 0, the others computing every step.
NEVER_SKIP = {
    "fbcache": StepCacheConfig("fbcache", threshold=0.0),
    "taylorseer": StepCacheConfig("taylorseer", compute_every=1),
    "magcache": StepCacheConfig("magcache", compute_every=1),
    "pab": StepCacheConfig("pab", compute_every=1),
    "fastercache": StepCacheConfig("fastercache", interval=1),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def pipes():
    return {model: pipeline(model) for model in MODELS}


def _cached(pipe, config: StepCacheConfig, **stack):
    return apply_stack(pipe, StackConfig(cache=config, **stack))


def _run(pipe, model: str, steps: int = 4, threshold=None, **extra):
    with cache_request(pipe, steps=steps, threshold=threshold) as run:
        out = image(pipe, model, steps=steps, **extra)
    return out, run.stats


@pytest.mark.parametrize("config", [
    dict(method="teacache"), dict(method="fbcache", interval=2), dict(method="taylorseer", threshold=0.1),
    dict(method="fbcache", threshold=-1.0), dict(method="pab", compute_every=0), dict(method="taylorseer", warmup_steps=0),
    dict(method="magcache", retention=1.5), dict(method="magcache", mag_ratios="1,x"),
    dict(method="pab", timestep_range=(800, 100)), dict(method="magcache", compute_every=2, mag_ratios="flux"),
])
def test_bad_configs_are_refused_by_name(config):
    with pytest.raises(ValueError, match="cache|expected"):
        StepCacheConfig(**config)


def test_parameters_take_diffusers_defaults_and_say_which_apply():
    assert StepCacheConfig("fbcache").describe() == {"method": "fbcache", "threshold": 0.05}
    mag = StepCacheConfig("magcache", compute_every=4).describe()
    assert mag["compute_every"] == 4 and mag["max_skip"] == 3 and "interval" not in mag
    assert StepCacheConfig("fbcache").takes_threshold and not StepCacheConfig("fbcache", compute_every=2).takes_threshold
    with pytest.raises(ValueError, match="method 'pab' decides without one"):
        StepCacheConfig("pab").with_threshold(0.1)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("method", list(NEVER_SKIP))
def test_a_cache_that_never_skips_gives_the_uncached_image_bit_for_bit(pipes, model, method):
    pipe = pipes[model]
    want = image(pipe, model)
    stack = _cached(pipe, NEVER_SKIP[method])
    try:
        got, stats = _run(pipe, model)
    finally:
        stack.restore()
    assert stats["skipped"] == 0 and stats["computed"] > 0, stats
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(image(pipe, model), want)  # restored: the pipeline as it was


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("method", ["fbcache", "taylorseer", "magcache"])
def test_a_forced_schedule_computes_every_nth_step_and_counts_it(pipes, model, method):
    pipe = pipes[model]
    want = image(pipe, model, steps=6)
    stack = _cached(pipe, StepCacheConfig(method, compute_every=2))
    try:
        got, stats = _run(pipe, model, steps=6)
        again, _ = _run(pipe, model, steps=6)
    finally:
        stack.restore()
    assert stats == {"method": method, "unit": "steps", "computed": 3, "skipped": 3}
    assert np.isfinite(got).all() and np.abs(got - want).max() > 1e-4  # steps were skipped: another image
    np.testing.assert_array_equal(again, got)


def test_pab_counts_attention_calls(pipes):
    pipe = pipes["tiny-flux"]
    stack = _cached(pipe, StepCacheConfig("pab", compute_every=2))
    try:
        _, stats = _run(pipe, "tiny-flux", steps=4)
    finally:
        stack.restore()
    attentions = sum(1 for m in pipe.transformer.modules() if getattr(m, "processor", None) is not None)
    assert stats == {"method": "pab", "unit": "attention calls", "computed": 2 * attentions,
                     "skipped": 2 * attentions}


@pytest.mark.parametrize("model", MODELS)
def test_a_second_request_equals_itself_run_alone_even_after_a_cancelled_one(pipes, model):
    """Request A (another prompt and seed), then B: B is what B alone gives. A cancelled A (stopped mid-loop, so
    diffusers' reset at the end of a call never ran) leaks nothing either; without the step cache's own reset the
    stale state does reach the next call (what the reset is for)."""
    pipe = pipes[model]
    config = StepCacheConfig("fbcache", threshold=1e9)  # every step after a request's first is skipped
    stack = _cached(pipe, config)
    try:
        alone, alone_stats = _run(pipe, model, steps=5)
        _run(pipe, model, steps=5, prompt="a cat on a sofa", seed=11)
        after, after_stats = _run(pipe, model, steps=5)

        def stop(pipe_, step, timestep, kwargs):
            if step == 2:
                raise KeyboardInterrupt("cancelled")
            return {}

        with pytest.raises(KeyboardInterrupt):
            _run(pipe, model, steps=5, prompt="a cat on a sofa", seed=11, callback_on_step_end=stop)
        after_cancel, _ = _run(pipe, model, steps=5)
        with pytest.raises(KeyboardInterrupt):  # the same cancelled call, and a plain call after it
            image(pipe, model, steps=5, prompt="a cat on a sofa", seed=11, callback_on_step_end=stop)
        try:
            leaked = image(pipe, model, steps=5)
        except RuntimeError:  # the stale residual does not even fit the new prompt's tokens (Qwen-Image)
            leaked = None
    finally:
        stack.restore()
    assert alone_stats["computed"] == 1 and after_stats == alone_stats, (alone_stats, after_stats)
    np.testing.assert_array_equal(after, alone)
    np.testing.assert_array_equal(after_cancel, alone)
    assert leaked is None or np.abs(leaked - alone).max() > 0


def test_a_request_threshold_applies_to_that_request_only(pipes):
    pipe = pipes["tiny-flux"]
    stack = _cached(pipe, StepCacheConfig("fbcache", threshold=1e9))  # skips every step after the first
    try:
        _, skipping = _run(pipe, "tiny-flux")
        _, never = _run(pipe, "tiny-flux", threshold=0.0)
        _, back = _run(pipe, "tiny-flux")
    finally:
        stack.restore()
    assert skipping["computed"] == 1 and never["skipped"] == 0 and back == skipping
    with pytest.raises(ValueError, match="no step cache runs"):
        with cache_request(pipe, threshold=0.1):
            pass


def test_gate_cond_leads_and_uncond_follows():
    gate = StepGate(threshold=0.5)
    prev = torch.ones(1, 4, 2)
    small, large = prev + 0.1, prev + 2.0
    assert gate.decide("cond", small, None) and gate.decide("uncond", large, prev)  # step 0 computes, both
    assert not gate.decide("cond", small, prev)  # 10 % < 50 %: skip
    assert not gate.decide("uncond", large, prev)  # follows its step's cond, whatever its own change
    assert gate.decide("cond", large, prev) and gate.decide("uncond", small, prev)
    assert gate.decide("uncond", small, prev) and gate.step == 4  # no lead this step (another rank's): it decides
    gate.begin(threshold=0.0)
    assert gate.step == 0 and gate.pending is None
    assert gate.decide("cond", small, None) and gate.decide("cond", prev.clone(), prev)  # 0 change, threshold 0


def test_gate_measures_a_cfg_batch_on_its_cond_half_and_a_forced_schedule_by_step():
    gate = StepGate(threshold=0.5)
    prev = torch.ones(2, 4, 2)
    pair = torch.cat([prev[:1] + 0.1, prev[1:] + 5.0])  # cond barely changed, uncond a lot
    assert gate.decide(PAIR_CONTEXT, pair, None) and not gate.decide(PAIR_CONTEXT, pair, prev)
    forced = StepGate(compute_every=3)
    assert [forced.decide("cond", prev, prev) for _ in range(7)] == [True, False, False, True, False, False, True]


@pytest.mark.parametrize("mode", ["regional", "full"])
def test_compiled_caches_trace_no_hook_and_recompile_nothing_per_step(pipes, mode):
    """Compile (Dynamo's eager backend) below the cache hooks: the cached image is the eager cached one; a
    second request with more steps, and a third with the first's, compile nothing (Dynamo's frame count
    unchanged); restore drops the graphs."""
    pipe, model = pipes["tiny-flux"], "tiny-flux"
    config = StepCacheConfig("fbcache", compute_every=2)
    eager = _cached(pipe, config)
    try:
        want = [_run(pipe, model, steps=s)[0] for s in (4, 7)]
    finally:
        eager.restore()
    stack = _cached(pipe, config, compile=CompileConfig(mode, backend="eager", vae=False))
    try:
        got4, stats = _run(pipe, model, steps=4)
        frames = tp.frames_converted()
        got7, _ = _run(pipe, model, steps=7)
        again4, _ = _run(pipe, model, steps=4)
        assert tp.frames_converted() == frames, "a later request compiled again"
        codes = list(stack.compiled.compiler._codes)
        assert "below the step cache's hooks" in stack.compiled.how
    finally:
        stack.restore()
    assert stats["skipped"] == 2
    for got, ref in ((got4, want[0]), (got7, want[1]), (again4, want[0])):
        np.testing.assert_array_equal(got, ref)
    assert codes and not any(tp.cache_entries(code) for code in codes)


def test_fp8_weights_compose_with_a_cache(pipes):
    from xstage_dit.features.fp8 import Fp8Config

    pipe = pipes["tiny-flux"]
    stack = _cached(pipe, StepCacheConfig("fbcache", compute_every=2), fp8=Fp8Config("weight"))
    try:
        got, stats = _run(pipe, "tiny-flux")
    finally:
        stack.restore()
    assert np.isfinite(got).all() and stats["computed"] == 2 and stats["skipped"] == 2


def test_refusals_name_their_reason(pipes):
    from xstage_dit.families import load_pipeline

    pipe = pipes["tiny-flux"]
    with pytest.raises(ValueError, match="compile mode 'graphs'.*cannot|recorded forward"):
        StackConfig(cache=StepCacheConfig("fbcache"), compile=CompileConfig("graphs"))
    one_block = load_pipeline("tiny-qwenimage", dtype=torch.float32, device="cpu", seed=0)
    with pytest.raises(ValueError, match="fbcache needs at least 2 transformer blocks .*got 1 in"):
        _cached(one_block, StepCacheConfig("fbcache"))
    assert not any("_diffusers_hook" in vars(m) for m in one_block.transformer.modules())
    nucleus = load_pipeline("tiny-nucleusmoe", dtype=torch.float32, device="cpu", seed=0)
    with pytest.raises(ValueError, match="block registry does not know.*taylorseer or pab"):
        _cached(nucleus, StepCacheConfig("magcache"))
    assert not any("_diffusers_hook" in vars(m) for m in nucleus.transformer.modules())
    with pytest.raises(ValueError, match="a bare FluxTransformer2DModel"):
        _cached(pipe.transformer, StepCacheConfig("pab"))
    stack = _cached(pipe, StepCacheConfig("taylorseer"))
    try:
        with pytest.raises(ValueError, match="method 'taylorseer' decides without one"):
            _run(pipe, "tiny-flux", threshold=0.1)
        assert handle_of(pipe) is stack.step_cache
    finally:
        stack.restore()
    assert handle_of(pipe) is None and pipe.transformer._cache_config is None
    assert not any("_diffusers_hook" in vars(m) for m in pipe.transformer.modules())
    from diffusers.hooks import FirstBlockCacheConfig

    other = load_pipeline("tiny-flux", dtype=torch.float32, device="cpu", seed=0)
    other.transformer.enable_cache(FirstBlockCacheConfig())  # a user's own diffusers cache
    with pytest.raises(ValueError, match="without a diffusers cache, got FirstBlockCacheConfig"):
        _cached(other, StepCacheConfig("taylorseer"))


def test_pab_reads_the_timestep_on_the_host_and_keeps_to_its_range(pipes, monkeypatch):
    from xstage_dit.features.step_cache import StepCacheHandle

    pipe, seen = pipes["tiny-flux"], []
    timestep = StepCacheHandle.timestep
    monkeypatch.setattr(StepCacheHandle, "timestep", lambda self: seen.append(timestep(self)) or seen[-1])
    counts = {}
    for window in ((-1.0, 1001.0), (1001.0, 2000.0)):
        seen.clear()
        stack = _cached(pipe, StepCacheConfig("pab", interval=2, timestep_range=window))
        try:
            _, counts[window] = _run(pipe, "tiny-flux", steps=4)
        finally:
            stack.restore()
        assert seen and all(isinstance(t, float) for t in seen)
        assert sorted(set(seen), reverse=True) == pipe.scheduler.timesteps.tolist()  # each step's, in order
    assert counts[(-1.0, 1001.0)]["skipped"] > 0 and counts[(1001.0, 2000.0)]["skipped"] == 0


def test_a_pipeline_without_cache_contexts_counts_steps_and_batches_cfg_consistently():
    """NucleusMoE's pipeline names no cache context and calls the transformer twice a step: the second call (the
    same latents) is the uncond branch, so a step counts once and a forced schedule skips whole steps; with CFG
    batching the pair runs as one batch under the pair's context and skips the same steps. (Its images are not
    compared: the tiny NucleusMoE's images differ between two applications of the same stack.)"""
    from xstage_dit.features import ParallelConfig
    from xstage_dit.families import load_pipeline, model_spec
    from xstage_dit.runtime.generation import call_kwargs

    pipe, spec = load_pipeline("tiny-nucleusmoe", dtype=torch.float32, device="cpu", seed=0), model_spec(
        "tiny-nucleusmoe")
    kwargs = call_kwargs(pipe, spec, prompt="a fox", seed=1, steps=4, height=32, width=32)
    for cfg_batch in (False, True):
        stack = apply_stack(pipe, StackConfig(parallel=ParallelConfig(cfg_batch=cfg_batch),
                                              cache=StepCacheConfig("taylorseer", compute_every=2)))
        try:
            point = stack.step_cache.points[0]
            with cache_request(pipe, steps=4) as cached:
                out = np.asarray(pipe(**kwargs).images)
                runs = point.runs
            pairs = [h.stats.get("batched_pairs") for h in stack.cfg_hooks]
        finally:
            stack.restore()
        assert np.isfinite(out).all() and pairs == ([4] if cfg_batch else []), pairs
        assert cached.stats == {"method": "taylorseer", "unit": "steps", "computed": 2, "skipped": 2}, cfg_batch
        assert runs == (4 if cfg_batch else 8)  # one hooked attention: a batched call a step, or the two branches


@pytest.mark.parametrize("model", ["tiny-wan", "tiny-flux"])
def test_taylorseer_state_that_would_not_fit_is_refused_by_its_size_and_leaves_nothing(pipes, model):
    """Where TaylorSeer's factors (max_order + 1 per attention output, per branch) exceed the free memory, the
    request is refused (StepCacheMemory, 507) at the branch's first attention output, naming the estimate and what
    to change; the next request with room is the image it gives alone. The estimate is the hooked layers' count x
    factors x that output's bf16 bytes."""
    from xstage_dit.features.step_cache.config import StepCacheMemory
    from xstage_dit.server.failures import failure_answer

    pipe = pipes[model]
    stack = _cached(pipe, StepCacheConfig("taylorseer", compute_every=2, max_order=2))
    check = handle_of(pipe).memory_check
    seen = []
    try:
        alone, _ = _run(pipe, model)
        check.headroom = lambda device: seen.append(device) or 1024
        with pytest.raises(StepCacheMemory, match=r"cache taylorseer would keep 3 factors of each of \d+ attention "
                           r"outputs of shape .* for the cond branch: about .* GiB, with 0\.0 GiB free on cpu") as err:
            _run(pipe, model)
        check.headroom = lambda device: 2**40
        after, _ = _run(pipe, model)
    finally:
        stack.restore()
    assert handle_of(pipe) is None  # restored
    assert check.layers == len([n for n, m in pipe.transformer.named_modules()
                                if getattr(m, "processor", None) is not None]), check.layers
    assert len(seen) == 1, seen  # one check per branch per request, at its first output
    out = torch.ones(2, 3, 4)
    assert check.need_bytes(out) == 24 * 2 * 3 * check.layers
    assert check.need_bytes((out, out)) == 2 * check.need_bytes(out)
    np.testing.assert_array_equal(after, alone)
    message, status = failure_answer(f"rank 1: StepCacheMemory: {err.value}")
    assert status == 507 and message == str(err.value), (status, message)
