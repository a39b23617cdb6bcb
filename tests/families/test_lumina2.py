"""Lumina-Image 2.0 (`xstage_dit/families/lumina2.py`): its record is found and bridged; the tiny pipeline under
`parallelize` at world 1, 2 and 4 (sp, and sp x cfg) gives one process's image; a saved folder generates through the
real CLI and the real HTTP server the image a direct call gives; full-lumina2 has the published sizes; the record's
text-depth fact is the layer the pipeline reads.

This file is also the rank program of its multi-process cases (``python tests/families/test_lumina2.py OUT WORLD``,
started by `xstage_dit.comm.launcher.launch` over gloo): every rank builds the same tiny pipeline, computes the
unpatched image itself, then the parallel one, restores and computes a third; each writes ``OUT.<rank>``.
"""

from __future__ import annotations

import base64
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

from tests.helpers.family_harness import (  # noqa: E402
    Tokens, check_parallel_ranks, equivalence, launch_ranks, pipeline_image, saved_folder_outputs)
from tests.helpers.tolerances import TOL  # noqa: E402

MODEL = "tiny-lumina2"
# one prompt (every sample as long: no mask), and two prompts of different lengths (the joint sequence padded,
# a (batch, seq) key mask split with it); 2x2 patches of the 8x latent: 4 x 4 and 3 x 5 image tokens
CASES = {
    "one-prompt": dict(prompt="a red fox in the snow", height=64, width=64),
    "two-prompts": dict(prompt=["a red fox in the snow", "a photo of a small cat on a big chair at night"], height=48,
                        width=80),
}
CONFIGS = {2: {"sp2": dict(sp=2), "cfg2": dict(cfg=2)}, 4: {"sp4": dict(sp=4), "sp2-cfg2": dict(sp=2, cfg=2)}}


def _image(pipe, case: dict, **extra) -> np.ndarray:
    return pipeline_image(pipe, MODEL, case, 4.0, **extra)


def _equivalence(pipe, config: dict, case: dict, ref: np.ndarray) -> dict:
    return equivalence(pipe, config, lambda: _image(pipe, case), ref)


def rank_main(out: str, world: int) -> int:
    from xstage_dit.comm.distributed import close_distributed, init_distributed
    from xstage_dit.families import load_pipeline

    info = init_distributed(backend="gloo", timeout_s=120)
    torch.set_num_threads(1)
    pipe = load_pipeline(MODEL, seed=0)
    results = {}
    for case_name, case in CASES.items():
        with Tokens(pipe.transformer) as tokens:
            ref = _image(pipe, case)
        results[f"{case_name}/single-tokens"] = sum(tokens)
        for config_name, config in CONFIGS[world].items():
            results[f"{case_name}/{config_name}"] = _equivalence(pipe, config, case, ref)
    if world == 2:  # last: a failing call leaves the process group unusable
        from xstage_dit.features import ParallelConfig, parallelize

        parallelize(pipe, ParallelConfig(cfg=2))
        try:  # CFG truncation: the last step runs the conditional branch alone
            _image(pipe, CASES["one-prompt"], cfg_trunc_ratio=0.5)
            results["error"] = None
        except Exception as exc:  # noqa: BLE001 - the test reads which error every rank ended with
            results["error"] = f"{type(exc).__name__}: {exc}"
    Path(f"{out}.{info.rank}").write_text(json.dumps(results))
    close_distributed()
    return 0


# ------------------------------------------------------------------------------------------------------- tests


def test_the_record_is_found_and_bridged():
    from diffusers import Lumina2Pipeline, Lumina2Transformer2DModel

    from xstage_dit.families import model_spec
    from xstage_dit.families.lumina2 import RECORD
    from xstage_dit.families.registry import record, record_for_pipeline, record_for_transformer, supported_pipelines
    from xstage_dit.features.plans import plan_for, supported_models

    assert record("lumina2") is RECORD and record_for_pipeline(Lumina2Pipeline.__name__) is RECORD
    assert record_for_transformer(Lumina2Transformer2DModel) is RECORD
    assert supported_pipelines()["Lumina2Pipeline"] == "lumina2"
    assert {model_spec(n).size for n in ("tiny-lumina2", "full-lumina2")} == {"tiny", "full"}
    model = RECORD.build_transformer("tiny", dtype=torch.float32, device="meta")
    plan = plan_for(model)
    assert (plan.family, plan.cfg, plan.pipeline_worlds) == ("Lumina-Image 2.0", "paired", (1, 2, 4))
    assert "Lumina2Transformer2DModel" in {p.class_name for p in supported_models()}


def test_world_1_matches_the_unpatched_pipeline():
    from xstage_dit.families import load_pipeline

    pipe = load_pipeline(MODEL, seed=0)
    for case in CASES.values():
        ref = _image(pipe, case)
        result = _equivalence(pipe, {}, case, ref)
        assert result["ref_std"] > 1e-3 and result["max_abs"] <= TOL.fp32_pipeline and result["restored"] == 0, result


def _launch(world: int, tmp_path: Path) -> list[dict]:
    return launch_ranks(__file__, "lumina2", world, tmp_path)


# world 4 (four ranks on the 2-core machine) took 16-19 s: not `slow`
@pytest.mark.parametrize("world", [2, 4])
def test_parallel_pipeline_matches_one_process(world, tmp_path):
    ranks = _launch(world, tmp_path)
    check_parallel_ranks(ranks, world, {case_name: CONFIGS[world] for case_name in CASES})
    if world == 2:
        errors = {r["error"] for r in ranks}
        assert len(errors) == 1 and "had no unconditional partner" in errors.pop(), ranks


def test_the_text_depth_fact_is_the_layer_the_pipeline_reads():
    """The record says encode_prompt reads Gemma's second-to-last hidden state: with every later layer skipped
    (the text-depth feature, which reads the record's fact) the prompt embedding is the same bits, and the last
    layer does not run."""
    from xstage_dit.families import load_pipeline
    from xstage_dit.features import text_depth

    pipe = load_pipeline(MODEL, seed=0)
    encode = dict(prompt="a red fox in the snow", do_classifier_free_guidance=False, max_sequence_length=128)
    ref = pipe.encode_prompt(**encode)[0]
    ran = []
    hook = pipe.text_encoder.layers[-1].mlp.register_forward_hook(lambda *args: ran.append(1))
    undo = text_depth.skip_unread_layers(pipe)
    assert undo is not None
    skipped = pipe.encode_prompt(**encode)[0]
    assert not ran and torch.equal(skipped, ref)
    undo()
    pipe.encode_prompt(**encode)
    hook.remove()
    assert ran  # the probe sees the layer when it runs


def test_a_saved_folder_generates_through_the_cli_and_the_server(tmp_path):
    from tests.helpers.server import assert_same_image, decode_png

    height, width = 64, 80
    out = saved_folder_outputs(MODEL, tmp_path / "my-lumina2", prompt="a red fox in the snow", seed=5, height=height,
                               width=width, bad_size=f"{width}x{height + 8}")
    spec = out["spec"]
    assert (spec.family, spec.size, spec.pipeline_class) == ("lumina2", "local", "Lumina2Pipeline")
    bad = out["bad"]
    assert bad.status_code == 422 and "16" in bad.text, bad.text  # the 16-pixel rule, before queueing
    assert base64.b64decode(out["served"]) == out["cli"]  # one request type, one pixel rule: the same PNG
    assert_same_image(decode_png(out["served"]), out["direct"], "served vs direct")
    assert out["direct"].std() > 1.0  # an image, not a constant


def test_full_lumina2_has_the_published_sizes():
    """Lumina-Image-2.0: a 2.61B transformer (2 609 769 152 here), Gemma-2-2B (2 614 341 888), the FLUX VAE (83.8M);
    built on the meta device (architecture only)."""
    from xstage_dit.families import load_pipeline
    from xstage_dit.features import check_degrees
    from xstage_dit.features.config import ParallelConfig

    pipe = load_pipeline("full-lumina2", dtype=torch.bfloat16, device="meta")
    billions = {c: sum(p.numel() for p in getattr(pipe, c).parameters()) / 1e9 for c in ("transformer", "text_encoder",
                                                                                           "vae")}
    assert billions["transformer"] == pytest.approx(2.6, rel=0.01), billions
    assert billions["text_encoder"] == pytest.approx(2.614, rel=0.001), billions
    assert billions["vae"] == pytest.approx(0.0838, rel=0.01), billions
    config = pipe.transformer.config
    assert (config.num_attention_heads, config.num_kv_heads, config.hidden_size) == (24, 8, 2304)
    check_degrees(pipe.transformer, ParallelConfig(sp=8, cfg=2))  # the plan takes the full model
    with pytest.raises(ValueError, match="at least sp=32 heads"):
        check_degrees(pipe.transformer, ParallelConfig(sp=32))


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1], int(sys.argv[2])))
