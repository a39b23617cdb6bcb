"""The feature stack: one declared order, each feature's undo run in reverse, and a restore that leaves the
process as it found it (no enum member, process-wide swap, communication buffer or other pipeline's graph)."""

from __future__ import annotations

import pytest
import torch

from xstage_dit import _torch_private as tp
from xstage_dit.engine import Engine, EngineConfig
from xstage_dit.features import ParallelConfig, apply_stack, parallelize
from xstage_dit.features.compile import CompileConfig
from xstage_dit.features.fp8 import Fp8Config
from xstage_dit.features.stack import FEATURES, ORDER, Feature, StackConfig
from xstage_dit.features.step_cache import StepCacheConfig
from xstage_dit.runtime.generation import call_kwargs
from tests.helpers.server import one_torch_thread


def _nucleusmoe(dtype: torch.dtype = torch.float32):
    """The tiny NucleusMoE (bfloat16 where it compiles: Dynamo's fake grouped_mm takes bf16 only)."""
    from xstage_dit.families import load_pipeline, model_spec

    return load_pipeline("tiny-nucleusmoe", dtype=dtype, device="cpu", seed=0), model_spec("tiny-nucleusmoe")


def _call(pipe, spec, seed: int = 1):
    kwargs = call_kwargs(pipe, spec, prompt="a fox", seed=seed, steps=2, height=32, width=32)
    with torch.inference_mode():
        return pipe(**{**kwargs, "output_type": "pt"}).images


def test_the_declared_order():
    """The order the features go in, written once (`stack.FEATURES`), each with why it sits there."""
    assert ORDER == ("attention_kernel", "expert_parallel", "compile_fixes", "fp8", "host_syncs", "step_cache",
                     "sequence_parallel", "collective_safety", "cfg_parallel", "cfg_batch", "cfg_pair_check",
                     "text_depth", "prompt_cache", "one_frame_vae", "batch_invariance", "lora", "compile")
    assert all(f.why for f in FEATURES) and len(set(ORDER)) == len(ORDER)
    assert {f.config for f in FEATURES} <= set(StackConfig.__dataclass_fields__)


def _recording(calls: list):
    def wrap(feature: Feature) -> Feature:
        def apply(pipe, config, ctx):
            calls.append(("apply", feature.name))
            undo = feature.apply(pipe, config, ctx)
            if undo is None:
                return None

            def recorded() -> None:
                calls.append(("undo", feature.name))
                undo()

            return recorded

        return Feature(feature.name, apply, feature.config, feature.why)

    return tuple(wrap(f) for f in FEATURES)


def test_the_stack_applies_in_the_declared_order_and_undoes_in_reverse():
    """Every feature on the tiny NucleusMoE (it has one of each: MoE layers, a rope with host copies, CFG that
    batches, an LLM text encoder read at an inner layer, a video VAE); each applied in `ORDER`, each undo in
    exactly the reverse order, the communication buffers freed after the last one."""
    calls: list = []
    pipe, spec = _nucleusmoe(torch.bfloat16)
    config = StackConfig(parallel=ParallelConfig(cfg_batch=True), compile=CompileConfig("regional", backend="eager"),
                         batch_invariance=True, fp8=Fp8Config("weight"),  # weight-only: the FP8 mode a CPU runs
                         cache=StepCacheConfig("taylorseer", compute_every=2))
    with one_torch_thread():
        stack = apply_stack(pipe, config, _recording(calls))
        try:
            applied = [name for kind, name in calls if kind == "apply"]
            # collective safety and CFG parallel apply nothing at sp=1, cfg=1 (their apply is called, returns None);
            # LoRA is not applied: NucleusMoE's pipeline has no diffusers LoRA loader (tests/features/test_lora.py
            # holds the LoRA feature's place in this order on FLUX)
            assert applied == [name for name in ORDER if name != "lora"] and stack.applied == applied
            _call(pipe, spec)
            comm = stack.ctx.comm
        finally:
            stack.restore()
    undone = [name for kind, name in calls if kind == "undo"]
    assert undone == [name for name in reversed(applied) if name in undone]
    assert set(undone) == set(ORDER) - {"attention_kernel", "collective_safety", "cfg_parallel", "lora"}
    assert comm.describe()["buffers"] == 0 and not stack.active
    stack.restore()  # idempotent
    assert [name for kind, name in calls if kind == "undo"] == undone


def test_a_feature_that_fails_leaves_nothing_applied():
    pipe, _ = _nucleusmoe()
    calls: list = []

    def failing(pipe, config, ctx):
        raise ValueError("expected a test failure, got it")

    features = tuple(Feature(f.name, failing, f.config, f.why) if f.name == "prompt_cache" else f
                     for f in _recording(calls))
    with pytest.raises(ValueError, match="expected a test failure"):
        apply_stack(pipe, StackConfig(), features)
    applied = [name for kind, name in calls if kind == "apply"]
    assert applied[-1] == "text_depth"
    assert [n for k, n in calls if k == "undo"] == [n for n in reversed(applied) if n in {"text_depth", "sequence_parallel",
                                                                                          "host_syncs", "compile_fixes",
                                                                                          "expert_parallel"}]
    assert "encode_prompt" not in vars(pipe) and not any("forward" in vars(m) for m in pipe.text_encoder.modules())
    parallelize(pipe).restore()  # not marked: a clean pipeline again


def test_engine_config_is_validated_and_names_the_bad_value():
    with pytest.raises(ValueError, match="expected dtype in float32, bfloat16, float16, got 'int8'"):
        EngineConfig(dtype="int8")
    with pytest.raises(ValueError, match="expected a device cpu, cuda or cuda:N, got 'tpu'"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match="expected batch_invariance True, False or 'auto', got 'on'"):
        EngineConfig(batch_invariance="on")
    with pytest.raises(ValueError, match="expected prompt_cache to be True or False, got 1"):
        EngineConfig(prompt_cache=1)
    with pytest.raises(ValueError, match="expected weights_seed to be an integer >= 0, got -1"):
        EngineConfig(weights_seed=-1)
    with pytest.raises(ValueError, match="expected compile to be a CompileConfig or None, got str"):
        EngineConfig(compile="regional")
    config = EngineConfig(device="cpu")
    assert config.dtype == torch.float32 and config.compile.mode == "off"  # a CPU's defaults
    assert config.stack_config("image").batch_invariance and not config.stack_config("video").batch_invariance
    with pytest.raises(ValueError, match="expected kind 'image' or 'video', got 'audio'"):
        config.stack_config("audio")


def test_the_engine_loads_applies_and_restores(tmp_path):
    """`Engine.start`: the model loaded through the family records, the stack applied (batch invariance for an
    image model), one restore; the features switched off are not applied."""
    with one_torch_thread():
        engine = Engine.start(EngineConfig(model="tiny-nucleusmoe", device="cpu", prompt_cache=False,
                                           text_depth=False))
        try:
            assert engine.stack.applied[-1] == "batch_invariance"  # compile is off on a CPU
            assert "prompt_cache" not in engine.stack.applied and "text_depth" not in engine.stack.applied
            assert engine.describe()["batch_invariance"]["small_row_linears"] > 0
            assert "encode_prompt" not in vars(engine.pipe)  # no prompt cache wrapped it
            with pytest.raises(RuntimeError, match="restore\\(\\) first"):
                engine.apply(engine.pipe)
        finally:
            pipe = engine.pipe
            engine.restore()
    assert engine.stack is None and "_xstage_batch_invariance" not in vars(pipe)


def test_restore_removes_the_attention_backend_member_with_its_last_user():
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    members = list(AttentionBackendName)
    # a handle an earlier test of this process left live keeps the member (rightly): restore leaves it as found
    held_before = "xstage_ulysses".upper() in AttentionBackendName.__members__
    first, _ = _nucleusmoe()
    second, _ = _nucleusmoe()
    a, b = parallelize(first), parallelize(second)
    try:
        assert AttentionBackendName("xstage_ulysses") in _AttentionBackendRegistry._backends
        a.restore()
        assert AttentionBackendName("xstage_ulysses").value == "xstage_ulysses"  # still used by the second
    finally:
        a.restore()
        b.restore()
    assert list(AttentionBackendName) == members
    if held_before:
        return
    assert "xstage_ulysses".upper() not in AttentionBackendName.__members__
    assert not any(getattr(m, "value", m) == "xstage_ulysses" for m in _AttentionBackendRegistry._backends)
    assert "xstage_ulysses" not in _AttentionBackendRegistry._supports_context_parallel
    with pytest.raises(ValueError):
        AttentionBackendName("xstage_ulysses")


def test_restore_puts_nucleusmoe_text_length_helper_back():
    from diffusers.models.transformers import transformer_nucleusmoe_image as mod

    original = mod._compute_text_seq_len_from_mask
    first, _ = _nucleusmoe()
    second, _ = _nucleusmoe()
    a = parallelize(first)
    b = parallelize(second)
    try:
        assert mod._compute_text_seq_len_from_mask is not original
        b.restore()
        assert mod._compute_text_seq_len_from_mask is not original  # the first still relies on it
    finally:
        b.restore()
        a.restore()
    assert mod._compute_text_seq_len_from_mask is original


def test_the_handle_owns_its_communication_buffers():
    """The ops of the handle's groups allocate into the handle's `CommBuffers`; restore frees them and hands the
    groups back (bare op calls: the process default). Here at world 1, where the group is None."""
    from xstage_dit.comm import buffers

    pipe, _ = _nucleusmoe()
    handle = parallelize(pipe)
    owner = handle.ctx.comm
    assert buffers.owner_for(None) is owner
    buffers.symmetric_buffer("ulysses_attention.out", (2, 8, 4, 16), torch.float32, torch.device("cpu"))
    assert owner.describe()["buffers"] == 1 and owner.describe()["bytes"] == 2 * 8 * 4 * 16 * 4
    handle.restore()
    assert owner.describe()["buffers"] == 0 and buffers.owner_for(None) is not owner


def test_compile_restore_drops_only_its_own_graphs():
    """Two pipelines of one family compiled in one process: restoring one leaves the other's graphs (no recompile,
    the same images); the restored one's compiled entries are gone (its code objects hold none)."""
    with one_torch_thread():
        first, spec = _nucleusmoe(torch.bfloat16)
        second, _ = _nucleusmoe(torch.bfloat16)
        config = EngineConfig(device="cpu", compile=CompileConfig("regional", backend="eager"))
        kept, dropped = Engine(config), Engine(config)
        try:
            kept.apply(second, kind="image")
            want = _call(second, spec)
            dropped.apply(first, kind="image")
            _call(first, spec)
            codes = list(dropped.stack.compiled.compiler._codes)
            assert codes and all(tp.cache_entries(code) for code in codes)
            dropped.restore()
            assert not any(tp.cache_entries(code) for code in codes)
            before = tp.frames_converted()
            assert torch.equal(_call(second, spec), want) and tp.frames_converted() == before
        finally:
            dropped.restore()
            kept.restore()
