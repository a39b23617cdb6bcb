"""xfuser as benchmark contenders (`xstage_dit.bench.xfuser_stack`): its pipeline wrapper and its model runner.

CPU: the pieces that need no xfuser (the runner's input arguments, the rebuilt pipeline, the reasons it cannot
run). xfuser itself refuses to import without an accelerator, so the runner runs in the GPU tests: tiny Wan and
tiny FLUX through xfuser's model runners (our weights), eager and compiled, against plain diffusers.
"""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import torch

from xstage_dit import cli
from xstage_dit.bench import contenders, lineup, xfuser_stack
from xstage_dit.families import load_pipeline


@pytest.fixture(scope="module")
def tiny_wan():
    pipe = load_pipeline("tiny-wan")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_runner_input_args_come_from_the_call_and_keep_the_schedule():
    kwargs = {"prompt": "a fox", "height": 480, "width": 832, "num_inference_steps": 2, "guidance_scale": 5.0,
              "num_frames": 81, "generator": object(), "output_type": "np"}
    args = xfuser_stack.runner_input_args(kwargs, seed=7, flow_shift=3.0)
    assert args == {"prompt": "a fox", "height": 480, "width": 832, "num_inference_steps": 2, "guidance_scale": 5.0,
                    "negative_prompt": None, "guidance_scale_2": None, "num_frames": 81, "max_sequence_length": 512,
                    "seed": 7, "flow_shift": 3.0}
    assert xfuser_stack.runner_input_args({**kwargs, "max_sequence_length": 32}, 7, None)["max_sequence_length"] == 32
    assert "flow_shift" not in xfuser_stack.runner_input_args(kwargs, seed=7, flow_shift=None)
    with pytest.raises(ValueError, match="num_inference_steps"):
        xfuser_stack.runner_input_args({k: v for k, v in kwargs.items() if k != "num_inference_steps"}, 0, None)


def test_rebuilt_pipeline_shares_components_and_carries_config():
    tiny_wan = load_pipeline("tiny-wan")
    tiny_wan.register_to_config(boundary_ratio=0.875, expand_timesteps=True)  # not the class defaults
    swapped = torch.nn.Identity()
    rebuilt = xfuser_stack.rebuilt_pipeline(tiny_wan, transformer=swapped)
    assert type(rebuilt) is type(tiny_wan)
    assert rebuilt.transformer is swapped
    assert rebuilt.vae is tiny_wan.vae and rebuilt.text_encoder is tiny_wan.text_encoder
    assert rebuilt.scheduler is tiny_wan.scheduler and rebuilt.tokenizer is tiny_wan.tokenizer
    assert rebuilt.config["boundary_ratio"] == 0.875 and rebuilt.config["expand_timesteps"] is True
    assert tiny_wan.transformer is not swapped  # the original pipeline keeps its own
    with pytest.raises(ValueError, match="unet"):
        xfuser_stack.rebuilt_pipeline(tiny_wan, unet=swapped)


def test_runner_models_name_a_runner_and_a_transformer_class():
    assert set(xfuser_stack.RUNNER_MODELS) == {"FluxPipeline", "WanPipeline"}
    for pipeline, model in xfuser_stack.RUNNER_MODELS.items():
        assert pipeline.endswith("Pipeline") and model.name
        module, sep, attribute = model.transformer.partition(":")
        assert sep and module.startswith("xfuser.") and attribute.startswith("xFuser")
    assert xfuser_stack.RUNNER_MODELS["FluxPipeline"].sets_input_parameters  # its _run_pipe does, per call


def test_check_names_the_pin_where_xfuser_is_missing(monkeypatch, tiny_wan):
    monkeypatch.setattr(xfuser_stack, "_version", lambda name: None)
    usp, runner = lineup.make_contenders(["xfuser-usp", "xfuser-runner"], False)[:2]
    assert isinstance(usp, xfuser_stack.XFuserUSP) and isinstance(runner, xfuser_stack.XFuserRunner)
    for contender in (usp, runner):
        reason = contender.check(None)
        assert reason == f"xfuser is not installed (the bench extra pins xfuser=={xfuser_stack.XFUSER_PIN})"


def test_the_runner_leaves_inductor_as_it_found_it():
    import torch._inductor.config as inductor

    saved = xfuser_stack._inductor_overlap_config()
    assert saved  # torch has these settings; a rename would silently stop the restore
    before = inductor.reorder_for_compute_comm_overlap
    try:
        inductor.reorder_for_compute_comm_overlap = not before  # what a runner's compile sets process-wide
        xfuser_stack._set_inductor_overlap_config(saved)
        assert inductor.reorder_for_compute_comm_overlap == before
    finally:
        inductor.reorder_for_compute_comm_overlap = before


@pytest.mark.parametrize("own", [True, False])
def test_usp_restore_puts_back_the_transformers_own_forward(own):
    """xfuser's compile sets a `forward` on the transformer instance; the restore must leave the instance's own
    `forward` (a diffusers hook's, another patch's) where it had one, and none where it had none."""

    class Pipe:
        transformer = torch.nn.Linear(2, 2)

    class Holder:
        pipe = Pipe()

    transformer = Holder.pipe.transformer
    hook_forward = lambda x: x  # noqa: E731
    if own:
        transformer.forward = hook_forward
    usp = xfuser_stack.XFuserUSP(compile=False, world_size=1)
    # what apply() records before xfuser's wrapper runs, then what the wrapper does
    usp.saved = {"transformer": transformer}
    usp.keep_own_forward(transformer)
    transformer.forward = lambda x: -x  # xfuser's compiled forward
    usp.restore(Holder())
    if own:
        assert vars(transformer)["forward"] is hook_forward
    else:
        assert "forward" not in vars(transformer)
        assert transformer.forward.__func__ is torch.nn.Linear.forward


def test_the_default_timed_module_is_the_pipeline_transformer(tiny_wan):
    class Holder:
        pipe = tiny_wan

    assert contenders.PlainDiffusers(False).timed_module(Holder()) is tiny_wan.transformer


@pytest.mark.gpu
@pytest.mark.parametrize("model,runner,forwards", [("tiny-wan", "Wan2.1-T2V", 2.0), ("tiny-flux", "FLUX.1-dev", 1.0)])
def test_xfuser_runner_gpu(tmp_path, model, runner, forwards):
    """xfuser's model runner over our weights, eager and compiled (its own mode: CUDA graphs for FLUX), in one run
    with plain diffusers; every forward of its transformer timed (Wan: two a step, CFG), and what it makes is
    diffusers' output within bf16 kernels."""
    try:
        importlib.metadata.version("xfuser")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("xfuser is not installed (the bench extra)")
    rc = cli.main(["bench", "--model", model, "--device", "cuda", "--num-prompts", "1", "--steps", "2",
                   "--contenders", "diffusers,xfuser-runner", "--compile", "regional", "--out-dir", str(tmp_path)])
    assert rc == 0
    (json_path,) = tmp_path.glob(f"e2e-{model}-1x*.json")
    rows = {r["name"]: r for r in json.loads(json_path.read_text(encoding="utf-8"))["rows"]}
    for name in ("xfuser-runner", "xfuser-runner+compile"):
        row = rows[name]
        assert row["status"] == "ok", row
        assert row["xfuser_runner"].startswith(runner), row
        assert row["transformer_forwards_per_step"] == forwards
        assert row["output_max_abs_diff_vs_diffusers"] < 0.2  # bf16: kernels may differ; garbage is ~0.5+


def test_the_runner_transformer_shares_our_buffers_and_keeps_its_own():
    class Ours(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rope = torch.nn.Module()
            self.rope.register_buffer("freqs", torch.arange(4, dtype=torch.float64), persistent=False)

    class Theirs(Ours):
        def __init__(self):
            super().__init__()
            self.register_buffer("head_perm", torch.arange(2), persistent=False)

    ours, theirs = Ours(), Theirs()
    xfuser_stack._share_buffers(theirs, ours)
    assert theirs.rope.freqs is ours.rope.freqs  # ours: the same values in the same dtype, not a fresh copy
    assert theirs.head_perm.tolist() == [0, 1]  # its own stays
