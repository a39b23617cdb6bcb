"""The LoRA feature on tiny FLUX, Wan and Qwen-Image: each adapter's image is the one diffusers' own
``load_lora_weights`` + ``set_adapters`` give on an untouched pipeline, in any order of switching (A -> B -> none ->
A, two combined), from diffusers/PEFT and kohya files; bad adapters fail naming the problem and change nothing;
the least recently used adapter is evicted; restore leaves the transformer as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xstage_dit.engine import Engine, EngineConfig
from xstage_dit.features.compile import CompileConfig
from xstage_dit.features.lora import AdapterError, AdapterLimit, UnknownAdapter
from xstage_dit.features.stack import ORDER
from tests.helpers.lora import (diffusers_references, image, load_fp32, same_snapshot, snapshot, write_kohya_flux,
                                write_peft)
from tests.helpers.server import one_torch_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


def _engine(model: str, lora_dir, **fields) -> Engine:
    """The LoRA feature alone (no parallel or pipeline patches, no batch invariance: Wan's cached empty prompt
    differs from its fresh encoding by ~5e-7): the diffusers computation, exactly."""
    fields.setdefault("compile", CompileConfig("off"))
    engine = Engine(EngineConfig(model=model, device="cpu", parallel=None, batch_invariance=False, lora_dir=str(lora_dir),
                                 host_syncs=False, text_depth=False, prompt_cache=False, one_frame_vae=False, **fields))
    engine.apply(engine.load())
    return engine


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-wan", "tiny-qwenimage"])
def test_each_adapter_set_gives_diffusers_own_image_in_any_order(model, tmp_path):
    ref = load_fp32(model)
    plain, want = diffusers_references(ref, model, tmp_path, (0.7, -0.5))

    engine = _engine(model, tmp_path)
    pipe = engine.pipe
    before = snapshot(pipe.transformer)
    try:
        assert np.array_equal(image(engine.pipe, model), plain)
        for key, adapters in (("a", [("a", 0.7)]), ("b", ["b"]), (None, None), ("a", [{"name": "a", "scale": 0.7}]),
                              ("ab", [("a", 0.7), ("b", -0.5)])):
            engine.activate_loras(adapters)
            got = image(engine.pipe, model)
            assert np.array_equal(got, plain if key is None else want[key]), f"{model}: {adapters}"
        assert np.abs(want["a"] - plain).max() > 1e-3  # the adapter changes the image
        rows = {r["name"]: r for r in engine.loras()}
        assert rows["a"]["resident"] and rows["a"]["rank"] == 4 and rows["b"]["active_scale"] == -0.5
    finally:
        engine.restore()
    assert same_snapshot(snapshot(pipe.transformer), before)  # no LoRA layer or attribute left, the same weights


def test_restore_leaves_the_transformer_bit_identical(tmp_path):
    model = "tiny-flux"
    engine = Engine(EngineConfig(model=model, device="cpu", parallel=None, batch_invariance=False,
                                 compile=CompileConfig("off"), lora_dir=str(tmp_path)))
    pipe = engine.load()
    write_peft(pipe.transformer, tmp_path / "a.safetensors", rank=4, seed=1)
    plain = image(pipe, model)  # first: a pipeline call leaves diffusers' (empty) hook registry on the transformer
    before = snapshot(pipe.transformer)
    engine.apply(pipe)
    engine.activate_loras(["a"])
    assert not np.array_equal(image(pipe, model), plain)
    engine.restore()
    assert same_snapshot(snapshot(pipe.transformer), before)
    assert np.array_equal(image(pipe, model), plain)


def test_a_kohya_file_gives_the_image_diffusers_converts_it_to(tmp_path):
    model = "tiny-flux"
    ref = load_fp32(model)
    config = ref.transformer.config
    dim = config.num_attention_heads * config.attention_head_dim
    path = write_kohya_flux(tmp_path / "kohya-style.safetensors", dim=dim, mlp=4 * dim, rank=4, seed=5)
    ref.load_lora_weights(str(path), adapter_name="k")
    ref.set_adapters(["k"], [0.9])
    want = image(ref, model)
    engine = _engine(model, tmp_path)
    try:
        engine.activate_loras([("kohya-style", 0.9)])
        assert np.array_equal(image(engine.pipe, model), want)
        assert {r["name"]: r["rank"] for r in engine.loras()}["kohya-style"] == 4
    finally:
        engine.restore()


def test_bad_adapters_fail_naming_the_problem_and_change_nothing(tmp_path):
    model = "tiny-flux"
    flux, wan = load_fp32(model), load_fp32("tiny-wan")
    write_peft(flux.transformer, tmp_path / "good.safetensors", rank=4, seed=1)
    write_peft(wan.transformer, tmp_path / "wan-style.safetensors", rank=4, seed=2)  # another family's adapter
    write_peft(flux.transformer, tmp_path / "big.safetensors", rank=8, seed=3)  # above max_lora_rank
    wide = write_peft(flux.transformer, tmp_path / "wide.safetensors", rank=4, seed=4)
    from safetensors.torch import load_file, save_file

    state = load_file(str(wide))
    key = next(k for k in state if k.endswith("attn.to_q.lora_A.weight"))
    state[key] = torch.zeros(4, 48)  # another model size: 48 inputs where the layer has 32
    save_file(state, str(wide))
    text = {**load_file(str(tmp_path / "good.safetensors")), "text_encoder.text_model.x.lora_A.weight": torch.zeros(1)}
    save_file(text, str(tmp_path / "with-text.safetensors"))
    (tmp_path / "corrupt.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")

    engine = _engine(model, tmp_path, max_lora_rank=4, max_loras=2, max_loras_per_request=2)
    try:
        engine.activate_loras(["good"])
        good = image(engine.pipe, model)
        before = snapshot(engine.pipe.transformer)
        cases = [(["missing"], UnknownAdapter, "no adapter 'missing'"),
                 (["wan-style"], AdapterError, "does not have (an adapter for another model family?)"),
                 (["big"], AdapterLimit, "rank <= max_lora_rank=4, got 8"),
                 (["wide"], AdapterError, "expected shape (rank, 32)"),
                 (["with-text"], AdapterError, "text-encoder"),
                 (["corrupt"], AdapterError, "could not be read as a LoRA"),
                 ([("good", 9.0)], AdapterLimit, "expected a scale in [-4, 4], got 9"),
                 (["good", "big", "wide"], AdapterLimit, "at most 2 adapters in one request, got 3"),
                 (["good", "good"], AdapterLimit, "each adapter once")]
        for adapters, kind, words in cases:
            with pytest.raises(kind) as info:
                engine.activate_loras(adapters)
            assert words in str(info.value), (adapters, str(info.value))
            assert same_snapshot(snapshot(engine.pipe.transformer), before), f"{adapters} changed the model"
            assert engine.lora.resident() == ["good"] and engine.lora.active == (("good", 1.0),)
        assert np.array_equal(image(engine.pipe, model), good)  # still served, still the same image
        assert UnknownAdapter("x").status == 404 and AdapterLimit("x").status == 400
    finally:
        engine.restore()


def test_the_least_recently_used_adapter_is_evicted_never_an_active_one(tmp_path):
    model = "tiny-flux"
    pipe = load_fp32(model)
    for i, name in enumerate("abc"):
        write_peft(pipe.transformer, tmp_path / f"{name}.safetensors", rank=2, seed=i)
    engine = _engine(model, tmp_path, max_loras=2, max_loras_per_request=2, preload_loras=("a",))
    try:
        assert engine.lora.resident() == ["a"] and engine.lora.active == ()
        engine.activate_loras(["b"])
        engine.activate_loras(["a"])  # a used last: b is the least recently used
        engine.activate_loras(["c"])
        assert engine.lora.resident() == ["a", "c"]
        engine.activate_loras(["b", "c"])  # a evicted, not c (active)
        assert engine.lora.resident() == ["b", "c"]
        peft = engine.pipe.get_list_adapters()["transformer"]
        assert len(peft) == 2  # evicted adapters' layers are gone from the model
    finally:
        engine.restore()


def test_the_feature_sits_before_compile_and_undoes_with_the_stack(tmp_path):
    """Applied after batch invariance and before compile (`stack.ORDER`); the slots exist before tracing."""
    assert ORDER.index("batch_invariance") < ORDER.index("lora") == ORDER.index("compile") - 1
    pipe = load_fp32("tiny-flux")
    write_peft(pipe.transformer, tmp_path / "a.safetensors", rank=2, seed=1)
    before = snapshot(pipe.transformer)
    engine = Engine(EngineConfig(device="cpu", lora_dir=str(tmp_path), compile=CompileConfig("regional", backend="eager"),
                                 max_loras_per_request=1, max_lora_rank=4))
    stack = engine.apply(pipe, kind="image")
    try:
        assert stack.applied[-2:] == ["lora", "compile"] and stack.lora.graph_variants == 2
        assert len(stack.lora.slots.layers) == sum(kind == "Linear" for _, kind in before[0])
    finally:
        engine.restore()
    assert same_snapshot(snapshot(pipe.transformer), before)


def test_an_adapter_that_runs_out_of_memory_while_loading_is_refused_and_leaves_nothing(tmp_path):
    """A test double for the device running out of memory half way through diffusers' load (the adapter's layers
    injected, then torch.OutOfMemoryError): AdapterMemory (the server's 507), the model as it was."""
    from xstage_dit.features.lora import AdapterMemory

    model = "tiny-flux"
    pipe = load_fp32(model)
    write_peft(pipe.transformer, tmp_path / "a.safetensors", rank=4, seed=1)
    write_peft(pipe.transformer, tmp_path / "b.safetensors", rank=4, seed=2)
    engine = _engine(model, tmp_path)
    try:
        engine.activate_loras(["a"])
        with_a = image(engine.pipe, model)
        before = snapshot(engine.pipe.transformer)
        real = engine.pipe.load_lora_weights

        def load_then_run_out(*args, **kwargs):
            real(*args, **kwargs)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        engine.pipe.load_lora_weights = load_then_run_out
        with pytest.raises(AdapterMemory) as info:
            engine.activate_loras(["a", "b"])
        del engine.pipe.load_lora_weights
        assert info.value.status == 507 and "adapter 'b'" in str(info.value) and "GiB" not in str(info.value)
        assert same_snapshot(snapshot(engine.pipe.transformer), before)
        assert engine.lora.resident() == ["a"] and np.array_equal(image(engine.pipe, model), with_a)
    finally:
        engine.restore()


def test_adapters_compose_with_a_step_cache(tmp_path):
    """Issue 42's composition with LoRA, tiny FLUX: under a cache that never skips, each adapter set gives diffusers'
    own image bit for bit; under a forced schedule (every other step computed), switching adapters between requests
    leaks nothing through the cache's state (a, none, a: the first and last equal, the adapter still changes it)."""
    from xstage_dit.features.step_cache import StepCacheConfig, cache_request

    model = "tiny-flux"
    plain, want = diffusers_references(load_fp32(model), model, tmp_path, (0.7, -0.5))

    def requests(engine) -> list:
        out = []
        for adapters in ([("a", 0.7)], None, [("a", 0.7)]):
            engine.activate_loras(adapters)
            with cache_request(engine.pipe, steps=2) as run:
                got = image(engine.pipe, model)  # 2 steps
            out.append((got, run.stats))
        return out

    engine = _engine(model, tmp_path, cache=StepCacheConfig("fbcache", threshold=0.0))
    try:
        got = requests(engine)
    finally:
        engine.restore()
    assert [s["computed"] for _, s in got] == [2, 2, 2]
    assert np.array_equal(got[0][0], want["a"]) and np.array_equal(got[1][0], plain)
    assert np.array_equal(got[2][0], want["a"])

    engine = _engine(model, tmp_path, cache=StepCacheConfig("fbcache", compute_every=2))
    try:
        got = requests(engine)
    finally:
        engine.restore()
    assert [(s["computed"], s["skipped"]) for _, s in got] == [(1, 1)] * 3
    assert np.array_equal(got[0][0], got[2][0]) and np.abs(got[0][0] - got[1][0]).max() > 1e-3
