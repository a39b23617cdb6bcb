"""xfuser as a benchmark contender (`xstage_dit.bench.xfuser_stack`).

CPU: the pieces that need no xfuser (the runner's input arguments, the rebuilt pipeline, the reasons it cannot
run). xfuser itself refuses to import without an accelerator, so its two paths run in the GPU test: tiny Wan
through xfuser's model runner (our weights), eager and compiled, against plain diffusers in one `bench` run.
"""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import torch

from xstage_dit import cli
from xstage_dit.bench import contenders, xfuser_stack
from xstage_dit.models import load_pipeline


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
                    "negative_prompt": None, "guidance_scale_2": None, "num_frames": 81, "seed": 7, "flow_shift": 3.0}
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
    for pipeline, (runner, transformer) in xfuser_stack.RUNNER_MODELS.items():
        assert pipeline.endswith("Pipeline") and runner
        module, sep, attribute = transformer.partition(":")
        assert sep and module.startswith("xfuser.") and attribute


def test_check_names_the_pin_where_xfuser_is_missing(monkeypatch, tiny_wan):
    monkeypatch.setattr(xfuser_stack, "_version", lambda name: None)
    contender = contenders.make_contenders(["xfuser-usp"], False)[0]
    assert isinstance(contender, xfuser_stack.XFuserUSP)
    reason = contender.check(None)
    assert reason == f"xfuser is not installed (the bench extra pins xfuser=={xfuser_stack.XFUSER_PIN})"


def test_the_default_timed_module_is_the_pipeline_transformer(tiny_wan):
    class Holder:
        pipe = tiny_wan

    assert contenders.PlainDiffusers(False).timed_module(Holder()) is tiny_wan.transformer


@pytest.mark.gpu
def test_xfuser_runs_wan_through_its_runner_gpu(tmp_path):
    """Tiny Wan: xfuser's Wan 2.1 runner over our weights, eager and compiled, in one run with plain diffusers;
    every transformer forward timed (two a step: CFG), and the video it makes is diffusers' within bf16 kernels."""
    try:
        importlib.metadata.version("xfuser")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("xfuser is not installed (the bench extra)")
    rc = cli.main(["bench", "--model", "tiny-wan", "--device", "cuda", "--num-prompts", "1", "--steps", "2",
                   "--contenders", "diffusers,xfuser-usp", "--compile", "regional", "--out-dir", str(tmp_path)])
    assert rc == 0
    (json_path,) = tmp_path.glob("e2e-tiny-wan-1x*.json")
    rows = {r["name"]: r for r in json.loads(json_path.read_text(encoding="utf-8"))["rows"]}
    for name in ("xfuser-usp", "xfuser-usp+compile"):
        row = rows[name]
        assert row["status"] == "ok", row
        assert row["xfuser_path"].startswith("model runner Wan2.1-T2V"), row
        assert row["transformer_forwards_per_step"] == 2.0
        assert row["output_max_abs_diff_vs_diffusers"] < 0.2  # bf16: kernels may differ; garbage is ~0.5+
