"""One record per family (`families/<family>.py`): every record names classes diffusers has and facts that agree
with each other; what is derived from the records (built-in models, local folders, plans) covers them all; a
class no record names is refused with a clear error; HiDream's square rule at sp > 1 is a request validation."""

from __future__ import annotations

import dataclasses
import importlib
import sys

import pytest
import torch

from xstage_dit.families import MODELS, model_spec
from xstage_dit.families.record import (SERVED_TASKS, FamilyRecord, ImageInputFacts, SequenceParallelFacts,
                                       SizeLimits)
from xstage_dit.families.registry import (NOT_SUPPORTED, causal_conv_classes, record, record_for_pipeline,
                                          record_for_transformer, records, supported_pipelines, video_vae_facts)
from xstage_dit.families.spec import ModelSpec

NAMES = sorted(records())


def _module_of(diffusers_class: str):
    import diffusers

    return sys.modules[getattr(diffusers, diffusers_class).__module__]


def _resolve(path: str):
    module, _, attribute = path.partition(":")
    target = importlib.import_module(module)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


def _tiny_transformer(name: str) -> torch.nn.Module:
    """The family's tiny transformer on the meta device (architecture only); the test fixtures' for the families
    without a built-in model."""
    r = record(name)
    if r.build_transformer is not None:
        return r.build_transformer("tiny", dtype=torch.float32, device="meta")
    fixture = importlib.import_module(f"tests.helpers.{name.replace('-', '_')}")
    return fixture.build_transformer("tiny", dtype=torch.float32, device="meta")


@pytest.mark.parametrize("name", NAMES)
def test_every_record_names_what_diffusers_has_and_agrees_with_itself(name):
    import diffusers

    r = record(name)
    assert r.name == name
    for cls in (*r.pipelines, *r.transformers):
        assert hasattr(diffusers, cls), cls
    for spec in r.specs:
        assert (spec.family, spec.kind) == (name, r.kind) and spec.pipeline_class in r.served_pipelines
        assert spec.square_under_sp == r.limits.square_under_sp and spec.real_weights_example == r.real_weights_example
        assert MODELS[spec.name] is spec
        config = r.transformer_dims[spec.size]
        assert r.sp.heads_key in config and (r.experts is None or r.experts.count_key in config), spec.name
    transformer_module = _module_of(r.transformers[0])
    if r.experts is not None:
        assert hasattr(transformer_module, r.experts.layer_class)
        assert _resolve(r.experts.ep_layer).__name__ == r.experts.ep_layer.rpartition(":")[2]
    for cls in (*r.facts.rope_host_sync_classes, *r.facts.grouped_mm_expert_classes):
        assert hasattr(transformer_module, cls), cls
    vae = r.facts.video_vae
    if vae is not None:
        assert hasattr(diffusers, vae.vae_class) and hasattr(_module_of(vae.vae_class), vae.causal_conv_class)
    if r.sp.cfg == "batched":
        assert r.sp.cfg_batch_dims, "batched CFG names the batch dim of every input"


@pytest.mark.parametrize("name", NAMES)
def test_every_plan_builds_on_the_tiny_transformer_and_names_resolvable_processors(name):
    from xstage_dit.features.plans import plan_for
    from xstage_dit.features.sequence_parallel import attention_modules

    model = _tiny_transformer(name)
    assert record_for_transformer(model) is record(name)
    plan = plan_for(model)
    assert plan.family == record(name).title and plan.class_name == type(model).__name__
    spec = plan.build_sp(model)
    processors = {type(m.processor).__name__ for _, m in attention_modules(model)}
    for original, swap in spec.processor_swaps.items():
        assert original in processors, (original, processors)
        assert callable(_resolve(swap) if isinstance(swap, str) else swap)


def test_what_is_derived_from_the_records_covers_them_all():
    assert set(MODELS) == {s.name for r in records().values() for s in r.specs}
    assert supported_pipelines() == {p: r.name for r in records().values() for p in r.served_pipelines}
    for r in records().values():
        for pipeline, task in r.pipelines.items():
            assert record_for_pipeline(pipeline) is r
            assert (pipeline in r.served_pipelines) == (SERVED_TASKS.get(task) == r.kind)
    from xstage_dit.features.plans import supported_models

    assert {p.class_name for p in supported_models()} == {t for r in records().values() for t in r.transformers}
    assert set(causal_conv_classes()) == {"QwenImageCausalConv3d", "WanCausalConv3d"}
    assert video_vae_facts("AutoencoderKLWan").streams_frames and video_vae_facts("AutoencoderKL") is None


def test_a_record_that_disagrees_with_its_specs_is_refused_by_name():
    spec = ModelSpec(name="tiny-x", family="x", size="tiny", kind="image", pipeline_class="FluxPipeline",
                     patch_multiple=16, height=64, width=64, steps=1, guidance=1.0)
    facts = SequenceParallelFacts(plan_source="diffusers", build=lambda model: None)

    def make(**changes):
        fields = dict(name="x", title="X", kind="image", pipelines={"FluxPipeline": "t2i"},
                      transformers=("FluxTransformer2DModel",), sp=facts, specs=(spec,), build=lambda *a, **k: None)
        return FamilyRecord(**{**fields, **changes})

    assert make().specs[0] == spec  # agrees
    with pytest.raises(ValueError, match=r"tiny-x to agree with its family record 'y', got family='x'"):
        make(name="y")
    with pytest.raises(ValueError, match=r"kind='image' \(record: 'video'\)"):
        make(kind="video", pipelines={"FluxPipeline": "t2v"})
    with pytest.raises(ValueError, match="pipeline_class='FluxPipeline'"):
        # not a pipeline `generate` / `serve` run for an image family (issue 39 serves edits: a video task here)
        make(pipelines={"FluxPipeline": "i2v"}, image_inputs={"FluxPipeline": ImageInputFacts()})
    with pytest.raises(ValueError, match=r"expected ImageInputFacts for the image-conditioned pipelines .* "
                                         r"got a mismatch for \['FluxPipeline'\]"):
        make(pipelines={"FluxPipeline": "edit"})  # an edit pipeline says how it takes its images
    with pytest.raises(ValueError, match=r"optional images only on its others\), got a mismatch for \['FluxPipeline'\]"):
        make(image_inputs={"FluxPipeline": ImageInputFacts()})  # a text pipeline needing an image
    assert make(image_inputs={"FluxPipeline": ImageInputFacts(min_images=0)}).specs[0] == spec  # optional ones
    with pytest.raises(ValueError, match=r"patch_multiple=16 \(record: 32\)"):
        make(specs=(dataclasses.replace(spec, size="full"),), limits=SizeLimits(patch_multiple=32))
    with pytest.raises(ValueError, match="expected a build function"):
        make(build=None)
    with pytest.raises(ValueError, match="expected pipeline tasks"):
        make(pipelines={"FluxPipeline": "t2a"})


def test_a_transformer_without_a_record_is_refused_with_a_clear_error():
    from diffusers import PixArtTransformer2DModel

    from xstage_dit.features import parallelize
    from xstage_dit.features.plans import plan_for

    with torch.device("meta"):
        pixart = PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=1,
                                          cross_attention_dim=16, caption_channels=16, sample_size=8)
    assert record_for_transformer(pixart) is None
    with pytest.raises(ValueError, match=r"expected a supported transformer \(.*FluxTransformer2DModel.*\) or a "
                                         r"subclass of one, got PixArtTransformer2DModel"):
        plan_for(pixart)
    with pytest.raises(ValueError, match="got Linear"):
        parallelize(torch.nn.Linear(2, 2))
    # a class diffusers ships but `parallelize` refuses says why
    cosmos = type("Cosmos3OmniTransformer", (torch.nn.Module,), {})()
    with pytest.raises(ValueError, match="mixture-of-transformers"):
        plan_for(cosmos)
    assert "Cosmos3OmniTransformer" in NOT_SUPPORTED


def test_a_folder_of_a_pipeline_without_a_record_is_refused_naming_its_class(tmp_path):
    for class_name, needle in (("PixArtAlphaPipeline", "got 'PixArtAlphaPipeline'"),
                               ("ChronoEditPipeline", "an 'edit' pipeline of the family 'chronoedit'; `generate` and `serve` run the t2v and i2v ones of "
                                                     "a video family")):
        folder = tmp_path / class_name
        folder.mkdir()
        (folder / "model_index.json").write_text(f'{{"_class_name": "{class_name}"}}')
        with pytest.raises(ValueError, match=needle):
            model_spec(str(folder))


def test_a_user_subclass_resolves_to_its_family_record():
    from diffusers import FluxPipeline, FluxTransformer2DModel

    class MyFlux(FluxTransformer2DModel):
        pass

    class MyFluxPipeline(FluxPipeline):
        pass

    assert record_for_transformer(MyFlux) is record("flux") and record_for_pipeline(MyFluxPipeline) is record("flux")
    assert record_for_pipeline("MyFluxPipeline") is None  # a folder names the class itself


# ---- HiDream takes only square sizes at sp > 1: a request validation ---------------------------------------------

def test_the_square_rule_is_checked_with_the_sp_degree():
    spec = model_spec("tiny-hidream")
    assert spec.square_under_sp and not model_spec("tiny-flux").square_under_sp
    spec.check_size(64, 128, sp=1)
    spec.check_size(128, 128, sp=2)
    with pytest.raises(ValueError, match=r"expected a square size \(width == height\) for tiny-hidream at sp=2.*"
                                         r"got 128x64"):
        spec.check_size(64, 128, sp=2)
    model_spec("tiny-flux").check_size(64, 128, sp=2)


def test_the_cli_refuses_a_non_square_hidream_size_at_sp_2_before_any_rank(capsys):
    from xstage_dit.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", "tiny-hidream", "--sp", "2", "--ep", "2", "--width", "128", "--height", "64"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "expected a square size" in err and "got 128x64" in err and "started" not in err


def test_the_server_answers_a_non_square_hidream_size_at_sp_2_with_422_naming_size():
    import httpx

    from tests.helpers.server import live_server, one_torch_thread
    from xstage_dit.families import load_pipeline
    from xstage_dit.server.app import create_app
    from xstage_dit.server.config import ServedModel, ServerConfig
    from xstage_dit.server.ranks import LoadedModel
    from xstage_dit.server.protocol import RequestError, parse_size
    from xstage_dit.server.worker import Worker

    spec = model_spec("tiny-hidream")
    served = ServedModel.from_spec("tiny-hidream", spec, sp=2)
    assert served.square_only and not ServedModel.from_spec("tiny-hidream", spec, sp=1).square_only
    config = ServerConfig(api_key=None, warmup=False, max_batch_size=1)
    with pytest.raises(RequestError) as bad:
        parse_size("128x64", served, config)
    assert (bad.value.param, bad.value.status) == ("size", 422)
    assert parse_size("64x64", served, config) == (64, 64)
    # through HTTP: refused before it is queued (the pipeline here runs at world 1: only the check is under test)
    pipe = load_pipeline("tiny-hidream")
    worker = Worker(lambda ctx: LoadedModel(pipe, served, {"model": served.name, "calibration": None}), config)
    worker.start()
    try:
        assert worker.wait_ready(60), worker.reason
        with one_torch_thread(), live_server(create_app(worker)) as url, httpx.Client(base_url=url, timeout=120) as c:
            r = c.post("/v1/images/generations", json={"prompt": "a fox", "size": "128x64", "num_inference_steps": 1})
            assert r.status_code == 422 and r.json()["error"]["param"] == "size", r.text
            assert "expected a square size" in r.json()["error"]["message"]
            r = c.post("/v1/images/generations", json={"prompt": "a fox", "size": "64x64", "num_inference_steps": 1})
            assert r.status_code == 200, r.text
    finally:
        worker.stop()


def test_reading_every_record_imports_neither_diffusers_nor_transformers():
    """The CLI's pre-checks read the records before any rank starts, in about the time of --help: a family file
    imports diffusers and transformers only inside its build functions."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = ("import sys; from xstage_dit.families.registry import records; from xstage_dit.families import MODELS; "
            "records(); print(sorted(m for m in ('diffusers', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
