"""Fused LoRA (``lora_mode="fused"``) on tiny FLUX, Wan and Qwen-Image: each adapter set's image is, byte for byte,
the one diffusers' own ``set_adapters`` + ``fuse_lora`` give; switching A -> B -> none -> A writes each set straight
from the saved copy and "none" gives back every weight's bytes from before LoRA existed; a merge that fails half way
leaves every weight as it was; the auto rule (injected memory numbers) and the mode per activation."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from xstage_dit.engine import Engine, EngineConfig
from xstage_dit.features.compile import CompileConfig
from xstage_dit.features.lora import AdapterMemory, LoraServingConfig
from xstage_dit.features.lora import fused as fused_ops
from xstage_dit.features.lora import manager as manager_module
from xstage_dit.features.device_memory import DeviceMemory
from xstage_dit.features.lora.fused import choose_mode, headroom
from tests.helpers.lora import (diffusers_fused_references, diffusers_references, image, linear_weights, load_fp32,
                                load_reference_adapters, same_bytes, same_snapshot, snapshot, write_kohya_flux,
                                write_peft)
from tests.helpers.server import one_torch_thread

GiB = 2 ** 30
SETS = (("a", ["a"], [0.7]), ("b", ["b"], [1.0]), ("ab", ["a", "b"], [0.7, -0.5]))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


def _engine(model: str, lora_dir, pipe=None, **fields) -> Engine:
    """The LoRA feature alone (as tests/features/test_lora.py builds it: the diffusers computation exactly)."""
    fields.setdefault("compile", CompileConfig("off"))
    fields.setdefault("lora_mode", "fused")
    engine = Engine(EngineConfig(model=model, device="cpu", parallel=None, batch_invariance=False,
                                 lora_dir=str(lora_dir), host_syncs=False, text_depth=False, prompt_cache=False,
                                 one_frame_vae=False, **fields))
    engine.apply(engine.load() if pipe is None else pipe)
    return engine


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-wan", "tiny-qwenimage"])
def test_fused_images_are_diffusers_fuse_lora_images_and_none_gives_back_every_weight(model, tmp_path):
    ref = load_fp32(model)
    plain = load_reference_adapters(ref, model, tmp_path)
    want = diffusers_fused_references(ref, model, SETS)
    ref.set_adapters(["a"], [0.7])
    unfused_a = image(ref, model)

    pipe = load_fp32(model)
    before, original = snapshot(pipe.transformer), linear_weights(pipe.transformer)  # before LoRA existed
    engine = _engine(model, tmp_path, pipe)
    manager = engine.lora
    try:
        for key, adapters in (("a", [("a", 0.7)]), ("b", ["b"]), (None, None), ("a", [("a", 0.7)]),
                              ("ab", [("a", 0.7), ("b", -0.5)])):
            engine.activate_loras(adapters)
            got = image(pipe, model)
            assert np.array_equal(got, plain if key is None else want[key]), f"{model}: {adapters}"
            if key is None:
                assert same_bytes(linear_weights(pipe.transformer), original) == []
                assert engine.lora.mode_in_use is None
            else:
                assert engine.lora.mode_in_use == "fused" and engine.lora.fused.merged == engine.lora.active
        assert np.abs(want["a"] - unfused_a).max() > 0  # fused and unfused differ in the last bits: a real check
        engine.activate_loras(["b"])
        rows = {r["name"]: r for r in engine.loras()}
        assert rows["b"]["mode"] == "fused" and rows["a"]["mode"] is None and rows["a"]["resident"]
        assert engine.lora.fingerprint()[2:] == ("fused", (("b", 1.0),))
    finally:
        engine.restore()
    assert same_snapshot(snapshot(pipe.transformer), before)  # no layer, attribute or weight byte left behind
    assert manager.fused.saved == {} and manager.fused.merged == ()  # the saved copies freed


def test_adapters_with_their_own_alpha_fuse_as_diffusers_does(tmp_path):
    """An adapter whose PEFT metadata sets lora_alpha 3 at rank 4 (the merge scales by ``scale * alpha / r``) and a
    kohya file (diffusers converts its alpha into the weights): diffusers' fused images, byte for byte."""
    model = "tiny-flux"
    ref = load_fp32(model)
    dim = ref.transformer.config.num_attention_heads * ref.transformer.config.attention_head_dim
    kohya = write_kohya_flux(tmp_path / "kohya-style.safetensors", dim=dim, mlp=4 * dim, rank=4, seed=5)
    alpha = write_peft(ref.transformer, tmp_path / "alpha3.safetensors", rank=4, seed=6, alpha=3)
    ref.load_lora_weights(str(kohya), adapter_name="k")
    ref.load_lora_weights(str(alpha), adapter_name="x")
    want = diffusers_fused_references(ref, model, (("k", ["k"], [0.9]), ("x", ["x"], [0.7]), ("kx", ["x", "k"],
                                                                                               [0.7, 0.9])))
    engine = _engine(model, tmp_path)
    try:
        for key, adapters in (("k", [("kohya-style", 0.9)]), ("x", [("alpha3", 0.7)]),
                              ("kx", [("alpha3", 0.7), ("kohya-style", 0.9)])):
            engine.activate_loras(adapters)
            assert np.array_equal(image(engine.pipe, model), want[key]), adapters
        layer = next(iter(engine.lora._resident["alpha3"].tensors.values()))
        assert (layer.alpha, layer.r, layer.scaling(0.7)) == (3, 4, 0.7 * 3 / 4)
    finally:
        engine.restore()


def test_a_merge_that_fails_half_way_leaves_every_weight_as_it_was(tmp_path, monkeypatch):
    """A test double makes the fifth delta of a switch raise (or run out of memory): the activation fails, every
    weight holds its bytes from before, no saved copy of the failed switch stays, the next image is the one before."""
    model = "tiny-flux"
    pipe = load_fp32(model)
    write_peft(pipe.transformer, tmp_path / "a.safetensors", rank=4, seed=1)
    write_peft(pipe.transformer, tmp_path / "b.safetensors", rank=2, seed=2)
    engine = _engine(model, tmp_path, pipe)
    real = fused_ops.delta_weight
    try:
        engine.activate_loras([("a", 0.5)])
        with_a, weights, saved = image(pipe, model), linear_weights(pipe.transformer), set(engine.lora.fused.saved)
        for error, kind in ((RuntimeError("merge broke"), RuntimeError), (torch.OutOfMemoryError("CUDA out of memory. "
                            "Tried to allocate 2.00 GiB"), AdapterMemory)):
            calls = [0]

            def failing(layer, scale, error=error):
                calls[0] += 1
                if calls[0] == 5:
                    raise error
                return real(layer, scale)

            monkeypatch.setattr(fused_ops, "delta_weight", failing)
            with pytest.raises(kind) as info:
                engine.activate_loras([("b", 1.0), ("a", 0.5)])
            monkeypatch.setattr(fused_ops, "delta_weight", real)
            assert calls[0] > 5  # it failed half way, then put the weights back
            if kind is AdapterMemory:
                assert info.value.status == 507 and "adapters b, a" in str(info.value) and "GiB" not in str(info.value)
            assert same_bytes(linear_weights(pipe.transformer), weights) == []
            assert engine.lora.active == (("a", 0.5),) and engine.lora.fused.merged == (("a", 0.5),)
            assert set(engine.lora.fused.saved) == saved and engine.lora.resident() == ["a"]
            assert np.array_equal(image(pipe, model), with_a)
        engine.activate_loras(["b"])  # and the next switch works
        assert engine.lora.fused.merged == (("b", 1.0),)
    finally:
        engine.restore()


def test_the_auto_rule_on_injected_memory_numbers():
    memory = DeviceMemory(free=10 * GiB, cached=2 * GiB, peak_extra=3 * GiB, total=64 * GiB)
    assert headroom(memory) == 3 * GiB + 2 * GiB  # the largest call + 1/32 of the device
    room = 12 * GiB - headroom(memory)
    assert choose_mode("auto", "cuda", room, memory)[0] == "fused"
    mode, why = choose_mode("auto", "cuda", room + 1, memory)
    assert mode == "unfused" and "does not fit" in why and f"{room / 2**20:.0f} MiB left" in why, why
    assert choose_mode("auto", "cuda", 0, None)[0] == "fused"  # the copies are held already
    assert choose_mode("auto", "cuda", 1, memory, plain=False)[0] == "unfused"
    assert choose_mode("auto", "cpu", 1, None)[0] == "unfused"
    assert choose_mode("fused", "cpu", 1, None) == ("fused", "mode fused")
    assert choose_mode("unfused", "cuda", 1, memory)[0] == "unfused"
    with pytest.raises(ValueError, match="expected a LoRA mode in auto, fused, unfused, got 'fast'"):
        choose_mode("fast", "cuda", 1, memory)
    with pytest.raises(ValueError, match="expected lora mode in auto, fused, unfused, got 'fast'"):
        LoraServingConfig(mode="fast")
    with pytest.raises(ValueError, match="got 'fast'"):
        EngineConfig(device="cpu", lora_dir=".", lora_mode="fast")
    assert LoraServingConfig(mode="fused").facts()["mode"] == "fused"


def test_auto_decides_per_activation_and_each_mode_gives_its_image(tmp_path, monkeypatch, caplog):
    """The rule's verdict injected (a test double for a device whose memory runs short, then frees): each set runs
    in the mode it was given, with that mode's image; each mode is logged once."""
    model = "tiny-flux"
    ref = load_fp32(model)
    plain, unfused = diffusers_references(ref, model, tmp_path, (0.7, -0.5))
    fused = diffusers_fused_references(ref, model, SETS)
    verdicts = iter(["fused", "unfused", "fused", "unfused"])
    seen = []

    def rule(mode, device_type, copy_bytes, memory, plain=True):
        seen.append(copy_bytes)
        return next(verdicts), "injected"

    monkeypatch.setattr(manager_module, "choose_mode", rule)
    engine = _engine(model, tmp_path, lora_mode="auto")
    original = linear_weights(engine.pipe.transformer)
    try:
        with caplog.at_level(logging.INFO, logger=manager_module.__name__):
            for key, adapters, mode in (("a", [("a", 0.7)], "fused"), ("b", ["b"], "unfused"), (None, None, None),
                                        ("ab", [("a", 0.7), ("b", -0.5)], "fused"), ("a", [("a", 0.7)], "unfused")):
                engine.activate_loras(adapters)
                want = plain if key is None else (fused if mode == "fused" else unfused)[key]
                assert np.array_equal(image(engine.pipe, model), want), (adapters, mode)
                assert engine.lora.mode_in_use == mode
                if mode != "fused":
                    assert same_bytes(linear_weights(engine.pipe.transformer), original) == []
        assert seen[0] > 0 and seen[2] == 0  # the second fused set targets layers whose copies are held
        told = [r.getMessage() for r in caplog.records if "auto mode runs adapters" in r.getMessage()]
        assert told == ["lora: auto mode runs adapters fused: injected", "lora: auto mode runs adapters unfused: "
                        "injected"], told
    finally:
        engine.restore()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_delta_is_peft_own_get_delta_weight(dtype, tmp_path):
    """`fused.delta_weight` of a harvested layer against PEFT's ``get_delta_weight`` after PEFT's ``set_scale``, byte
    for byte: scales 1 (no multiply), 0.7 and -0.5, lora_alpha 3 of rank 4, rsLoRA, float32 and bfloat16 (which PEFT
    multiplies in float32 on the CPU)."""
    from xstage_dit.families import load_pipeline
    from xstage_dit.features.lora.slots import harvest, lora_layers

    pipe = load_pipeline("tiny-flux", dtype=dtype, device="cpu", seed=0)
    pipe.load_lora_weights(str(write_peft(pipe.transformer, tmp_path / "x.safetensors", rank=4, seed=1, alpha=3)),
                           adapter_name="x")
    layers = lora_layers(pipe.transformer)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random A and B in the layers' own dtype (what a trained adapter holds)
        for layer in layers.values():
            for part in (layer.lora_A["x"], layer.lora_B["x"]):
                part.weight.copy_(torch.randn(part.weight.shape, generator=g))
    for rslora in (False, True):
        for layer in layers.values():
            layer.use_rslora["x"] = rslora
        ours = harvest(pipe.transformer, "x")
        for scale in (1.0, 0.7, -0.5):
            for name, layer in layers.items():
                layer.set_scale("x", scale)
                want, got = layer.get_delta_weight("x"), fused_ops.delta_weight(ours[name], scale)
                same = torch.equal(got.view(torch.uint8), want.view(torch.uint8))
                assert got.dtype == want.dtype == dtype and same, (name, scale, rslora)
