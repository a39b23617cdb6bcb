"""`apply_compile`: modes validated, compile after parallelize (world 1), the same image as eager, a bound
on compiled shapes past which a shape runs eager (logged once), and restore() giving the eager model back.
The "eager" torch.compile backend checks the wiring (dynamo traces every region) in seconds on a CPU."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from xstage_dit.features import ParallelConfig, parallelize
from xstage_dit.features.compile import apply_compile, call_key, check_compile_mode, default_compile_mode
from tests.helpers.server import one_torch_thread, tiny


@pytest.fixture(scope="module")
def flux():
    with one_torch_thread():
        pipe, served = tiny("tiny-flux")
        handle = parallelize(pipe, ParallelConfig())  # world 1: compile goes after it
        yield pipe, served
        handle.restore()


def _image(pipe, served, size, seed=0):
    return pipe("a fox", height=size, width=size, num_inference_steps=2, output_type="np",
                generator=torch.Generator("cpu").manual_seed(seed), **served.pipeline_kwargs).images


def test_modes_and_bounds_are_checked(flux):
    pipe, _ = flux
    assert default_compile_mode("cpu") == "off" and default_compile_mode(torch.device("cuda", 0)) == "regional"
    with pytest.raises(ValueError, match="expected a compile mode in off, regional, full, graphs, got .max."):
        check_compile_mode("max")
    with pytest.raises(ValueError, match="expected max_shapes to be an integer >= 1, got 0"):
        apply_compile(pipe, "regional", max_shapes=0)
    off = apply_compile(pipe, "off")
    assert off.how.startswith("eager") and "forward" not in vars(pipe.transformer)


@pytest.mark.parametrize("mode", ["regional", "full", "graphs"])
def test_bounded_shapes_then_eager_logged_once(flux, mode, caplog):
    pipe, served = flux
    want32, want64 = _image(pipe, served, 32), _image(pipe, served, 64)
    limit = torch._dynamo.config.recompile_limit
    handle = apply_compile(pipe, mode, max_shapes=1, backend="eager")
    try:
        assert torch._dynamo.config.recompile_limit >= 1
        if mode == "regional":
            assert handle.how.startswith("regional: 2 ") and "FluxTransformerBlock" in handle.how
        else:
            assert handle.how.startswith(f"{mode}: whole FluxTransformer2DModel")
        # the image VAE's decoder compiles too (84.6 -> 35.0 ms for FLUX 1024² on the H200)
        assert handle.how.endswith("; the AutoencoderKL decoder") and "forward" in vars(pipe.vae.decoder)
        with caplog.at_level(logging.WARNING, logger="xstage_dit.features.compile"):
            got32 = _image(pipe, served, 32)
            got64 = _image(pipe, served, 64)   # a second shape: past the bound of 1, eager
            again64 = _image(pipe, served, 64)
        assert len(handle.compiled_shapes) == 1 and len(handle.eager_shapes) == 1
        # the decoder under the same bound, counted apart: its 64² latent runs eager too
        assert len(handle.vae_compiled_shapes) == 1 and len(handle.vae_eager_shapes) == 1
        assert handle.describe()["vae_eager_shapes"] == 1
        past = [r.getMessage() for r in caplog.records if "past the bound" in r.getMessage()]
        assert len(past) == 2 and sum("vae decoder" in m for m in past) == 1, past  # once per shape and kind
        np.testing.assert_array_equal(got32, want32)
        np.testing.assert_array_equal(got64, want64)
        np.testing.assert_array_equal(again64, want64)
        with pytest.raises(RuntimeError, match="restore\\(\\) first"):
            apply_compile(pipe, mode)
    finally:
        handle.restore()
    assert "forward" not in vars(pipe.transformer)
    assert not any("_compiled_call_impl" in vars(m) for m in pipe.transformer.modules())
    assert "forward" not in vars(pipe.vae.decoder)
    assert torch._dynamo.config.recompile_limit == limit
    handle.restore()  # idempotent


def test_only_the_image_vae_decoder_compiles():
    """AutoencoderKL's decoder is the one VAE measured faster compiled; a video VAE (frame caches between
    chunks) or a pipeline without a VAE is left eager."""
    from types import SimpleNamespace

    from diffusers import AutoencoderKL, AutoencoderKLWan

    from xstage_dit.features.compile import _image_vae_decoder

    image = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4)
    assert _image_vae_decoder(SimpleNamespace(vae=image)) is image.decoder
    video = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1], num_res_blocks=1, temperal_downsample=[])
    assert _image_vae_decoder(SimpleNamespace(vae=video)) is None
    assert _image_vae_decoder(SimpleNamespace()) is None


def _nucleusmoe_eager_then_compiled(dtype: torch.dtype, mode: str, backend, **compile_kwargs):
    """Tiny NucleusMoE under parallelize (world 1): its images eager, then compiled in `mode` with `backend`;
    returns (eager images, compiled images, the parallelize handle's MoE layer count)."""
    from xstage_dit.families import load_pipeline, model_spec
    from xstage_dit.runtime.generation import call_kwargs

    with one_torch_thread():
        pipe = load_pipeline("tiny-nucleusmoe", dtype=dtype, device="cpu", seed=0)
        spec = model_spec("tiny-nucleusmoe")
        handle = parallelize(pipe, ParallelConfig())
        kwargs = lambda: call_kwargs(pipe, spec, prompt="a fox", seed=1, steps=2, height=32, width=32)  # noqa: E731
        with torch.inference_mode():
            want = pipe(**kwargs()).images
        compiled = apply_compile(pipe, mode, backend=backend, **compile_kwargs)
        try:
            with torch.inference_mode():
                got = pipe(**kwargs()).images
        finally:
            compiled.restore()
            handle.restore()
    return want, got, handle.num_moe_layers


def test_compile_over_the_world1_fused_moe_layer_stays_correct(monkeypatch):
    """NucleusMoE's EP layer at world 1 (what world1_path="fused" runs on a GPU): its expert-choice path has static
    offsets and traces without a graph break (tests/ops/test_moe_expert_choice.py); compiled it must give
    the eager images exactly. The swap is forced here (the CPU keeps diffusers' layer)."""
    import xstage_dit.features.expert_parallel as expert_parallel

    monkeypatch.setattr(expert_parallel, "_world1_path", lambda child, routing, where, seen, requested: "reference")
    want, got, moe_layers = _nucleusmoe_eager_then_compiled(torch.float32, "regional", "eager")
    assert moe_layers > 0
    np.testing.assert_array_equal(got, want)


def test_full_compile_traces_nucleusmoe_whole_with_its_host_copies_removed():
    """NucleusMoE compiled whole (`--compile full`: one Dynamo lookup a forward where regional makes one per
    block, 32 at full size: its compiled call is host-bound on the H200) traces without a graph break under
    parallelize (`patches.host_syncs`' rope cache steps aside while Dynamo traces) and gives the eager images."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    # bf16: Dynamo's fake grouped_mm takes bf16 only
    want, got, _ = _nucleusmoe_eager_then_compiled(torch.bfloat16, "full", counter, vae=False)
    # one graph for every forward: no break (a break makes two frames), and the tiny tokenizer gives the prompt and
    # the negative prompt one length
    assert counter.frame_count == 1, counter.frame_count
    np.testing.assert_array_equal(got, want)


def test_regional_compile_traces_one_graph_per_block_class():
    """Every block of a class shares one compiled graph under parallelize: nothing in the attention backend
    guards on a block's own name (that recompiled per block, and past the recompile limit ran eager on the
    H200: 162.6 vs 133.4 ms a FLUX step)."""
    import torch._dynamo.utils as dynamo_utils
    from diffusers import FluxTransformer2DModel

    from xstage_dit.families.flux import TRANSFORMER
    from xstage_dit.families.flux_inputs import transformer_inputs

    config = {**TRANSFORMER["tiny"], "num_layers": 3, "num_single_layers": 3}
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**config).eval()
    kw = transformer_inputs(model.config, height=32, width=32, text_tokens=8, dtype=torch.float32, device="cpu")
    handle = parallelize(model, ParallelConfig())
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    try:
        with torch.no_grad():
            eager = model(**kw)[0]
            model.compile_repeated_blocks(backend="eager")
            compiled = model(**kw)[0]
    finally:
        handle.restore()
        torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    # One graph per block class (FluxTransformerBlock, FluxSingleTransformerBlock), shared by its 3 blocks,
    # plus one recompile of the first single block for its input's strides (plain diffusers has it too).
    # With a guard on the block's name it was 6: one graph per block.
    assert dynamo_utils.counters["stats"]["unique_graphs"] <= 3, dict(dynamo_utils.counters["stats"])


@pytest.mark.parametrize("mode", ["regional", "full"])
def test_inductor_options_reach_every_compiled_graph(flux, mode, monkeypatch):
    """``options`` go to the compiled graphs of this call only (torch.compile's own per-graph options)."""
    pipe, _ = flux
    seen = []
    real_compile = torch.compile

    def recording_compile(fn=None, **kwargs):
        seen.append(kwargs.get("options"))
        return real_compile(fn, **{**kwargs, "options": None}) if fn is not None else real_compile(**kwargs)

    monkeypatch.setattr(torch, "compile", recording_compile)
    handle = apply_compile(pipe, mode, backend="eager", options={"coordinate_descent_tuning": True})
    try:
        assert seen and all(o == {"coordinate_descent_tuning": True} for o in seen), seen
    finally:
        handle.restore()
    seen.clear()
    apply_compile(pipe, mode, backend="eager").restore()
    assert seen and all(o is None for o in seen), seen


def test_graphs_compiles_the_transformer_under_cuda_graphs_and_not_the_vae(flux, monkeypatch):
    pipe, _ = flux
    seen = []
    real_compile = torch.compile

    def recording_compile(fn=None, **kwargs):
        seen.append((getattr(fn, "__qualname__", None) or type(fn).__name__, kwargs.get("options")))
        return real_compile(fn, **{**kwargs, "options": None, "backend": "eager"})

    monkeypatch.setattr(torch, "compile", recording_compile)
    handle = apply_compile(pipe, "graphs")  # Inductor: the backend whose option this is
    try:
        assert handle.how.startswith("graphs: whole FluxTransformer2DModel forward under CUDA graphs")
        options = [o for _, o in seen]
        assert options.count({"triton.cudagraphs": True}) == 1 and options.count(None) == 1, seen
    finally:
        handle.restore()


def test_graphs_starts_a_generation_per_call_and_hands_out_copies(flux, monkeypatch):
    """Each compiled call begins a new CUDA-graph generation, and what it returns is cloned out of the graph's
    pool, so a CFG pipeline's first forward survives its second; the images are the eager ones."""
    pipe, served = flux
    want = _image(pipe, served, 32)
    marks, outputs = [], []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    handle = apply_compile(pipe, "graphs", backend="eager")
    hook = pipe.transformer.register_forward_hook(lambda m, a, out: outputs.append(out))
    try:
        got = _image(pipe, served, 32)
        assert len(outputs) >= 2 and len(marks) == len(outputs)
        np.testing.assert_array_equal(got, want)
    finally:
        hook.remove()
        handle.restore()


def test_a_replayed_output_is_a_copy_the_next_replay_cannot_overwrite(monkeypatch):
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    from xstage_dit.features.compile import _replayed

    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)
    pool = torch.zeros(3)  # stands for the graph's static output memory

    def graph(value, as_output=False):
        pool.fill_(value)
        return Transformer2DModelOutput(sample=pool) if as_output else (pool, [pool], 7)

    call = _replayed(graph)
    first = call(1.0)
    second = call(2.0, as_output=True)
    assert first[0].tolist() == [1.0] * 3 and first[1][0].tolist() == [1.0] * 3 and first[2] == 7
    assert second.sample.tolist() == [2.0] * 3 and isinstance(second, Transformer2DModelOutput)
    assert first[0].data_ptr() != pool.data_ptr() != second.sample.data_ptr()


def test_vae_false_leaves_the_decoder_eager(flux):
    """The benchmark's plain-diffusers baseline compiles the transformer alone (what its users do)."""
    pipe, _ = flux
    handle = apply_compile(pipe, "regional", backend="eager", vae=False)
    try:
        assert "decoder" not in handle.how and "forward" not in vars(pipe.vae.decoder)
    finally:
        handle.restore()


def test_regional_layers_with_different_attributes_never_fall_back_to_eager(caplog):
    """Layers of one block class whose guarded attributes differ (NucleusMoE: dense and MoE layers, capacity
    factors) need a graph each per shape. Dynamo's default limit of 8 per code object silently ran the later
    ones eager on the H200; the limit is raised to layers x shapes, and restored. (Fails on the old limit: 5
    sizes x 2 layer kinds hit it.)"""
    limits = (torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit)
    with one_torch_thread():
        from xstage_dit.families import load_pipeline, model_spec
        from xstage_dit.server.config import ServedModel

        # bf16: Dynamo's fake grouped_mm takes bf16 only (the eager CPU kernel takes fp32 too)
        pipe = load_pipeline("tiny-nucleusmoe", dtype=torch.bfloat16, device="cpu", seed=0)
        served = ServedModel.from_spec("tiny-nucleusmoe", model_spec("tiny-nucleusmoe"))
        patched = parallelize(pipe, ParallelConfig())  # world 1, as the server runs it (compile goes after)
        moe = [m for m in pipe.transformer.modules() if hasattr(m, "capacity_factor")]
        assert moe, "expected NucleusMoE MoE layers with a capacity_factor (a guarded attribute)"
        sizes = (64, 96, 128, 160, 192)  # x 2 layer kinds (dense, MoE): past Dynamo's default 8 graphs
        handle = apply_compile(pipe, "regional", max_shapes=len(sizes), backend="eager")
        try:
            regions = len(pipe.transformer.transformer_blocks)
            assert torch._dynamo.config.recompile_limit >= len(sizes) * regions
            with caplog.at_level(logging.WARNING):
                for size in sizes:
                    pipe("a fox", height=size, width=size, num_inference_steps=1, output_type="np",
                         generator=torch.Generator("cpu").manual_seed(0), **served.pipeline_kwargs)
            hit = [r.getMessage() for r in caplog.records if "recompile_limit" in r.getMessage()]
            assert not hit, hit
            assert not handle.eager_shapes
        finally:
            handle.restore()
            patched.restore()
    assert (torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit) == limits


def test_warm_guards_skip_guards_only_for_a_call_key_that_ran(flux, monkeypatch):
    """guards="warm": a transformer call whose key (shapes, other arguments, grad mode) already ran compiled
    without compiling anything runs under skip_guard_eval_unsafe; a key's first call (it compiles), its second
    (the first to compile nothing), and every call under "full" evaluate all guards. The images equal the eager
    ones."""
    pipe, served = flux
    want32, want64 = _image(pipe, served, 32), _image(pipe, served, 64)
    stances = []
    real = torch.compiler.set_stance

    def recording(*args, **kwargs):
        stances.append(kwargs.get("skip_guard_eval_unsafe", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.compiler, "set_stance", recording)
    calls = []
    for guards in ("full", "warm"):
        stances.clear()
        handle = apply_compile(pipe, "regional", backend="eager", guards=guards)
        hook = pipe.transformer.register_forward_hook(lambda m, a, out: calls.append(1))
        try:
            assert handle.describe()["guards"] == guards
            assert ("warm guards" in handle.how) == (guards == "warm")
            calls.clear()
            np.testing.assert_array_equal(_image(pipe, served, 32), want32)
            first = len(calls)  # 2 steps, one forward each (FLUX.1-dev is guidance-distilled: no CFG)
            np.testing.assert_array_equal(_image(pipe, served, 32), want32)
            np.testing.assert_array_equal(_image(pipe, served, 64), want64)  # a new key: its first call is cold
            skipped = sum(stances)
            if guards == "full":
                assert skipped == 0 and not handle.warm_keys
            else:
                # every forward but the first two of each key (32 and 64: one timestep shape, one key each)
                assert first == 2 and len(calls) == 6 and len(handle.warm_keys) == 2
                assert skipped == len(calls) - 2 * len(handle.warm_keys)
        finally:
            hook.remove()
            handle.restore()
    # The mode is read on every call: a probe switches it on one handle to compare both on the same graphs.
    handle = apply_compile(pipe, "regional", backend="eager")
    try:
        stances.clear()
        np.testing.assert_array_equal(_image(pipe, served, 32), want32)
        assert sum(stances) == 0
        handle.guards = "warm"
        np.testing.assert_array_equal(_image(pipe, served, 32), want32)
        assert sum(stances) == 1  # its first warm-mode forward runs all guards, the second skips
        handle.guards = "full"
        np.testing.assert_array_equal(_image(pipe, served, 32), want32)
        assert sum(stances) == 1
    finally:
        handle.restore()
    with pytest.raises(ValueError, match="expected guards in full, warm, got 'none'"):
        apply_compile(pipe, "regional", backend="eager", guards="none")


def test_call_keys_tell_apart_what_a_graph_is_specialised_on():
    x = torch.zeros(2, 3)
    base = call_key((x,), {"attention_kwargs": {"scale": 1.0}, "return_dict": False})
    assert base == call_key((torch.ones(2, 3),), {"return_dict": False, "attention_kwargs": {"scale": 1.0}})
    assert base != call_key((torch.zeros(2, 4),), {"attention_kwargs": {"scale": 1.0}, "return_dict": False})
    assert base != call_key((x,), {"attention_kwargs": {"scale": 0.5}, "return_dict": False})  # a LoRA scale
    with torch.no_grad():
        assert base != call_key((x,), {"attention_kwargs": {"scale": 1.0}, "return_dict": False})
    # tensors inside other arguments count by shape, never by value (a repr would print them: slow, never equal)
    blocks = call_key((x,), {"samples": [torch.zeros(4, 2)], "attention_kwargs": {"mask": torch.zeros(3)}})
    assert blocks == call_key((x,), {"samples": [torch.ones(4, 2)], "attention_kwargs": {"mask": torch.ones(3)}})
    assert blocks != call_key((x,), {"samples": [torch.ones(5, 2)], "attention_kwargs": {"mask": torch.ones(3)}})


def test_text_encoders_compile_the_language_model_whole_for_every_prompt_length():
    """NucleusMoE's Qwen3-VL language model compiled whole with dynamic shapes: one graph, no break, for prompts of
    several lengths (the empty one too), the eager embeddings; off unless asked; restore gives the eager model."""
    from torch._dynamo.utils import counters

    from xstage_dit.families import load_pipeline

    pipe = load_pipeline("tiny-nucleusmoe", dtype=torch.float32, device=torch.device("cpu"), seed=0)
    cpu = torch.device("cpu")
    prompts = ["a fox", "a red fox in the snow at night", "", "x " * 40]
    with torch.no_grad():
        expected = [pipe.encode_prompt(prompt=[p], device=cpu)[0] for p in prompts]
    handle = parallelize(pipe, ParallelConfig())
    plain = apply_compile(pipe, "regional", backend="eager")
    assert "Qwen3VLTextModel" not in plain.how and "forward" not in vars(pipe.text_encoder.get_decoder())
    plain.restore()
    compiled = apply_compile(pipe, "regional", backend="eager", extras=("text-encoder",))
    try:
        assert "the Qwen3VLTextModel of text_encoder (whole, any prompt length)" in compiled.how
        counters.clear()
        with torch.no_grad():
            got = [pipe.encode_prompt(prompt=[p], device=cpu)[0] for p in prompts]
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    finally:
        compiled.restore()
        handle.restore()
    assert "forward" not in vars(pipe.text_encoder.get_decoder())
    for a, b in zip(got, expected):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_on_the_gpu_the_compile_extras_compile_with_inductor():
    """--compile-extra text-encoder,video-vae with Inductor on the GPU: the tiny NucleusMoE's text model for two
    prompt lengths and the tiny Wan VAE's chunked decode give the eager values to bfloat16 / float32 rounding."""
    from xstage_dit.families import load_pipeline

    cuda = torch.device("cuda")
    pipe = load_pipeline("tiny-nucleusmoe", dtype=torch.bfloat16, device=cuda, seed=0)
    with torch.no_grad():
        expected = [pipe.encode_prompt(prompt=[p], device=cuda)[0] for p in ("a fox", "a red fox in the snow")]
    handle = parallelize(pipe, ParallelConfig())
    compiled = apply_compile(pipe, "regional", extras=("text-encoder",))
    try:
        with torch.no_grad():
            got = [pipe.encode_prompt(prompt=[p], device=cuda)[0] for p in ("a fox", "a red fox in the snow")]
    finally:
        compiled.restore()
        handle.restore()
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)
    wan = load_pipeline("tiny-wan", dtype=torch.bfloat16, device=cuda, seed=0)
    vae = wan.vae
    video = torch.randn(1, vae.config.z_dim, 3, 8, 8, generator=torch.Generator().manual_seed(1)).to(cuda, vae.dtype)
    with torch.no_grad():
        want = vae.decode(video).sample
    handle = parallelize(wan, ParallelConfig())
    compiled = apply_compile(wan, "regional", extras=("video-vae",))
    try:
        with torch.no_grad():
            decoded = vae.decode(video).sample
    finally:
        compiled.restore()
        handle.restore()
    torch.testing.assert_close(decoded.float(), want.float(), rtol=5e-3, atol=5e-3)  # TF32 convolutions either way


def test_what_compiles_is_inside_the_hooks_that_pair_calls_in_python():
    """A hook with ``outside_compile`` (CFG pairing state) stays Python: the reference it calls through compiles;
    other hooks (the sequence-parallel split, the input check) stay inside the compiled chain."""
    from diffusers.hooks import HookRegistry, ModelHook

    from xstage_dit.features.compile import _compile_point

    class Plain(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            return args, kwargs

    class Pairing(ModelHook):
        outside_compile = True

        def new_forward(self, module, *args, **kwargs):
            return self.fn_ref.original_forward(*args, **kwargs)

    module = torch.nn.Linear(2, 2)
    assert _compile_point(module) == (module, "forward")
    registry = HookRegistry.check_if_exists_or_initialize(module)
    registry.register_hook(Plain(), "split")
    assert _compile_point(module) == (module, "forward")  # the whole chain, as without hooks
    chain = module.forward
    registry.register_hook(Pairing(), "pairs")
    registry.register_hook(Plain(), "outer")
    owner, attr = _compile_point(module)
    assert owner is registry.hooks["pairs"].fn_ref and attr == "original_forward"
    assert getattr(owner, attr) is chain  # the split hook and the module's forward, inside the pairing hook
