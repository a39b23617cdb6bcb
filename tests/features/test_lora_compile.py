"""Compiled (torch.compile, regional, on the CPU with Dynamo's eager backend: guards and recompiles are Dynamo's
whatever the backend), adapters are hot-swapped: after the warm-up (a call without LoRA and one with the slots on at
scale 0, what the server's warm-up runs) no adapter, scale, switch or combination converts a frame again
(Dynamo's own counters), and each image is still the adapter's. Fused (the adapters merged into the weights, the
LoRA layers off): the warm-up is the call without LoRA alone, and no switch converts a frame either."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xstage_dit import _torch_private as tp
from xstage_dit.engine import Engine, EngineConfig
from xstage_dit.features.compile import CompileConfig
from tests.helpers.lora import diffusers_references, image
from tests.helpers.server import one_torch_thread


@pytest.mark.slow
@pytest.mark.parametrize("slots", [1, 2])
def test_swapping_adapters_never_recompiles_after_warm_up(slots, tmp_path):
    """The feature stack as the server applies it (parallel features at world 1, the pipeline patches, batch
    invariance), with one slot (the slot's adapter changes on every switch) and two."""
    from xstage_dit.families import load_pipeline

    model = "tiny-flux"
    with one_torch_thread():
        ref = load_pipeline(model, dtype=torch.float32, device="cpu", seed=0)
        plain, want = diffusers_references(ref, model, tmp_path, (0.7, 0.5))

        engine = Engine(EngineConfig(model=model, device="cpu", compile=CompileConfig("regional", backend="eager"),
                                     lora_dir=str(tmp_path), max_lora_rank=4, max_loras_per_request=slots,
                                     lora_mode="unfused"))
        engine.apply(engine.load())
        try:
            lora = engine.lora
            assert lora.slots is not None and lora.graph_variants == 2
            warm = image(engine.pipe, model)
            with lora.warming():  # the LoRA-on graphs, at scale 0: the bytes of no LoRA
                assert np.array_equal(image(engine.pipe, model), warm)
            converted, graphs = tp.frames_converted(), tp.dynamo_counters()["stats"]["unique_graphs"]
            assert converted > 0  # it did compile
            got = {}
            cases = (("a", [("a", 0.7)]), ("b", ["b"]), ("none", None), ("a2", [("a", 0.7)]), ("scale", [("a", 0.3)]))
            for key, adapters in cases + ((("ab", [("a", 0.7), ("b", 0.5)]),) if slots == 2 else ()):
                engine.activate_loras(adapters)
                got[key] = image(engine.pipe, model)
            assert tp.frames_converted() == converted, "a swap converted a frame after warm-up"
            assert tp.dynamo_counters()["stats"]["unique_graphs"] == graphs
        finally:
            engine.restore()
    # The stack's patches (batch-invariant linear layers, the cached empty prompt) move the floats by ~1e-6; the
    # slots hold each adapter padded with zeros to rank 4: the same products and sums as diffusers' own layers.
    np.testing.assert_allclose(warm, plain, atol=1e-5)
    assert np.array_equal(got["none"], warm)
    for key in ("a", "b") + (("ab",) if slots == 2 else ()):
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, err_msg=key)
    np.testing.assert_array_equal(got["a2"], got["a"])
    assert np.abs(got["scale"] - got["a"]).max() > 1e-4  # the scale reached the compiled graphs


def test_fused_switches_never_recompile_after_warm_up(tmp_path):
    """The stack as the server applies it, fused: one warm-up call (the graphs without LoRA: the only ones a fused
    call runs), then every switch writes weights in place; each image is diffusers' fused one (up to the stack's
    patches, as above)."""
    from xstage_dit.families import load_pipeline
    from tests.helpers.lora import diffusers_fused_references, load_reference_adapters

    model = "tiny-flux"
    with one_torch_thread():
        ref = load_pipeline(model, dtype=torch.float32, device="cpu", seed=0)
        plain = load_reference_adapters(ref, model, tmp_path)
        want = diffusers_fused_references(ref, model, (("a", ["a"], [0.7]), ("b", ["b"], [1.0]),
                                                       ("ab", ["a", "b"], [0.7, 0.5])))
        engine = Engine(EngineConfig(model=model, device="cpu", compile=CompileConfig("regional", backend="eager"),
                                     lora_dir=str(tmp_path), max_lora_rank=4, lora_mode="fused"))
        engine.apply(engine.load())
        try:
            lora = engine.lora
            assert lora.slots is not None and lora.graph_variants == 1
            warm = image(engine.pipe, model)
            converted, graphs = tp.frames_converted(), tp.dynamo_counters()["stats"]["unique_graphs"]
            assert converted > 0
            got = {}
            for key, adapters in (("a", [("a", 0.7)]), ("b", ["b"]), ("none", None), ("a2", [("a", 0.7)]),
                                  ("scale", [("a", 0.3)]), ("ab", [("a", 0.7), ("b", 0.5)])):
                engine.activate_loras(adapters)
                assert lora.mode_in_use == (None if adapters is None else "fused")
                got[key] = image(engine.pipe, model)
            assert tp.frames_converted() == converted, "a fused switch converted a frame after warm-up"
            assert tp.dynamo_counters()["stats"]["unique_graphs"] == graphs
        finally:
            engine.restore()
    np.testing.assert_allclose(warm, plain, atol=1e-5)
    assert np.array_equal(got["none"], warm)
    for key in ("a", "b", "ab"):
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, err_msg=key)
    np.testing.assert_array_equal(got["a2"], got["a"])
    assert np.abs(got["scale"] - got["a"]).max() > 1e-4  # the scale reached the weights
