"""Issue 18: `parallelize` on the families users run, at the pipeline level, and never a hang.

Equivalence: the tiny pipeline of each family (real diffusers pipeline classes, random weights,
tokenizers in code) runs end to end at world 2 and 4 over gloo on the CPU and its image or video is
compared with the single-process one (the max abs error per family is printed: ``pytest -s``).
Failure cases (empty shard, disagreeing ranks, mismatched seeds, a processor bypassing
``dispatch_attention_fn``, one rank failing inside a forward): every rank ends with the same clear
error within 10 s.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "features" / "_families_worker.py")
TOL = 1e-4  # fp32 pipelines, pixels in [0, 1]: the parallel output differs by float reassociation only
FAMILIES = ["ltx", "cogvideox", "sd3", "z-image", "wan-vace", "skyreels-v2", "skyreels-v2-causal", "qwenimage",
            "helios", "chronoedit", "flux2", "ltx2", "qwenimage21", "qwenimage21-nocache", "hunyuanvideo",
            "hunyuanvideo15", "hunyuanimage", "hunyuanimage-distilled", "minimax-h3"]
# the registry's transformer class of each family case (the README's pipeline-test column comes from it)
FAMILY_CLASSES = {
    "ltx": "LTXVideoTransformer3DModel", "cogvideox": "CogVideoXTransformer3DModel", "sd3": "SD3Transformer2DModel",
    "z-image": "ZImageTransformer2DModel", "wan-vace": "WanVACETransformer3DModel",
    "skyreels-v2": "SkyReelsV2Transformer3DModel", "skyreels-v2-causal": "SkyReelsV2Transformer3DModel",
    "qwenimage": "QwenImageTransformer2DModel", "helios": "HeliosTransformer3DModel",
    "chronoedit": "ChronoEditTransformer3DModel", "flux2": "Flux2Transformer2DModel",
    "ltx2": "LTX2VideoTransformer3DModel", "qwenimage21": "QwenImage21Transformer2DModel",
    "qwenimage21-nocache": "QwenImage21Transformer2DModel", "hunyuanvideo": "HunyuanVideoTransformer3DModel",
    "hunyuanvideo15": "HunyuanVideo15Transformer3DModel", "hunyuanimage": "HunyuanImageTransformer2DModel",
    "hunyuanimage-distilled": "HunyuanImageTransformer2DModel", "minimax-h3": "MiniMaxH3Transformer3DModel",
}


def _launch(world: int, cases: list[str], tmp_path: Path, timeout_s: float = 400) -> list[dict]:
    from tests.helpers.preloaded import launch_preloaded

    # Named by a digest of the cases: joined names outgrow a file name (255 bytes) as families are added.
    out = tmp_path / f"{hashlib.sha1('-'.join(cases).encode()).hexdigest()[:12]}-w{world}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               XSTAGE_TEST_TIMEOUT="120", OMP_NUM_THREADS="1")
    code = launch_preloaded(world, WORKER, [str(out), *cases], env=env, timeout_s=timeout_s, logs=out)
    assert code == 0, f"world {world}: a rank exited with {code}"
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


# transformer level, on pipeline-shaped inputs the pipeline cases above do not reach: 9 image tokens (3, 2, 2, 2
# at world 4: the shard that used to be empty, and crashed rotary embedding on that rank alone), Helios with 3
# blocks (diffusers' own plan names exactly 40), LTX-2 (video + audio streams, text masks), FLUX.2 (9 tokens),
# ChronoEdit, and batches of 2 prompts padded differently: HunyuanImage 2.1, HunyuanVideo 1.5 (its valid_q &
# valid_k self-attention mask; its pipeline's VAE cannot decode a batch of 2), MiniMax-H3 (the fl2va layout: keyframe
# rows at their own timestep, batch 2; its pipeline runs t2va at batch 1)
TRANSFORMERS = ["qwenimage-9", "hunyuanvideo-9", "helios-3-blocks", "ltx2-12", "flux2-9", "chronoedit-18", "hunyuanimage-9",
                "hunyuanvideo15-18", "minimax-h3-35"]


# world 4 runs ~40 s on the 2-core CI machine (every family, 4 ranks on 2 cores)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_family_pipelines_match_single_process(world, tmp_path):
    # one name, one case: a transformer-level name equal to a pipeline one would run the pipeline twice instead
    assert not set(FAMILIES) & set(TRANSFORMERS), set(FAMILIES) & set(TRANSFORMERS)
    ranks = _launch(world, FAMILIES + TRANSFORMERS + ["subclass"], tmp_path)
    results = ranks[0]
    for name in TRANSFORMERS:
        r = results[name]
        print(f"world {world} {name} (transformer): max abs error {r['max_abs_parallel']:.2e}")
        assert r["finite"] and r["ref_std"] > 1e-3 and r["max_abs_parallel"] <= 1e-5, (name, r)
        assert r["tokens_parallel"] < r["tokens_single"], (name, r)
    for name in FAMILIES + ["subclass"]:
        r = results[name]
        print(f"world {world} {name}: max abs error {r['max_abs_parallel']:.2e} (pixels in [0, 1])")
        assert r["finite"] and r["ref_std"] > 1e-3, (name, r)  # a real image or video, not a constant
        assert r["max_abs_parallel"] <= TOL, (name, r)
        if name != "subclass":
            assert r["max_abs_restored"] == 0.0, (name, r)  # restore gives back the original pipeline exactly
            assert r["tokens_parallel"] < r["tokens_single"], (name, r)  # the attention really ran on shards


def test_readme_pipeline_column_is_what_this_file_tests():
    from xstage_dit.features.plans import supported_models

    from xstage_dit.families.registry import records

    claimed = {p.class_name for p in supported_models() if p.pipeline_worlds}
    tested_here = set(FAMILY_CLASSES.values())
    tested_elsewhere = {"FluxTransformer2DModel", "WanTransformer3DModel", "NucleusMoEImageTransformer2DModel",
                        "HiDreamImageTransformer2DModel"}  # tests/features/test_parallelize.py, world 2 and 4
    # a family record's pipeline worlds are tested in its own file, tests/families/test_<family>.py
    for r in records().values():
        if r.pipeline_worlds and not set(r.transformers) & (tested_here | tested_elsewhere):
            assert (ROOT / "tests" / "families" / f"test_{r.name}.py").is_file(), r.name
            tested_elsewhere |= set(r.transformers)
    assert claimed == tested_here | tested_elsewhere
    for p in supported_models():
        if p.class_name in tested_here:
            assert p.pipeline_worlds == (2, 4), p
    transformer_level = {"QwenImageTransformer2DModel", "HunyuanVideoTransformer3DModel", "HeliosTransformer3DModel",
                         "LTX2VideoTransformer3DModel", "Flux2Transformer2DModel",
                         "ChronoEditTransformer3DModel", "HunyuanImageTransformer2DModel",
                         "HunyuanVideo15Transformer3DModel", "MiniMaxH3Transformer3DModel"}  # TRANSFORMERS above
    assert {p.class_name for p in supported_models() if p.tested} == claimed | transformer_level


def test_subclasses_resolve_to_their_family_and_unknown_classes_are_named():
    from diffusers import SD3Transformer2DModel

    from xstage_dit.features.plans import plan_for

    class MySD3(SD3Transformer2DModel):
        pass

    model = MySD3(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=8,
                  num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16,
                  pos_embed_max_size=8)
    assert plan_for(model).family == "SD3 / SD3.5"

    class SD3Transformer2DModelLookalike(__import__("torch").nn.Module):
        pass

    SD3Transformer2DModelLookalike.__name__ = "SD3Transformer2DModel"  # same name, not diffusers' class
    with pytest.raises(ValueError, match="or a subclass of one, got SD3Transformer2DModel"):
        plan_for(SD3Transformer2DModelLookalike())


def test_symmetric_padding_masks_are_recognised():
    import torch

    from xstage_dit.features.attention_backend import _symmetric_padding

    valid = torch.tensor([[True, True, False], [True, False, False]])
    mask = (valid[:, :, None] & valid[:, None, :])[:, None]
    assert torch.equal(_symmetric_padding(mask, 3), valid)
    causal = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
    assert _symmetric_padding(causal, 3) is None  # not valid_q & valid_k: refused by the backend, not guessed
    assert _symmetric_padding(mask.float(), 3) is None


def test_helios_plan_follows_the_block_count():
    from diffusers import HeliosTransformer3DModel

    from xstage_dit.features.plans import plan_for

    model = HeliosTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                     text_dim=16, freq_dim=16, ffn_dim=16, num_layers=3)
    spec = plan_for(model).build_sp(model)
    gathers = sorted(k for k in spec.cp_plan if "*" not in k)
    assert gathers == sorted(f"blocks.{i}.{p}" for i in range(3) for p in ("attn1", "attn2", "ffn"))


# ------------------------------------------------------------------------------------------ failures

FAILURES = {
    # case: (world, what every rank's error must say)
    "disagree": (2, "expected every rank to pass the same config"),
    "seeds": (2, "expected every rank to pass the same inputs"),
    "bypass": (2, "SDPAFluxProcessor"),
    "short": (4, "expected at least sp=4 tokens"),
    "fail-one": (2, "injected failure in the single block"),
    "fail-one-even": (2, "injected failure in the single block"),
}


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_a_failure_is_the_same_clear_error_on_every_rank(case, tmp_path):
    world, message = FAILURES[case]
    t0 = time.monotonic()
    ranks = _launch(world, [case], tmp_path, timeout_s=120)
    errors = [r[case]["error"] for r in ranks]
    assert all(e is not None and message in e for e in errors), errors
    assert len(set(errors)) == 1, errors  # the same error on every rank
    # every rank ended within 10 s of the moment the last one reached the failing call (no rank waited out
    # the 120 s collective timeout; a rank still building its pipeline on the loaded machine is not waiting)
    entered = [r[case]["entered"] for r in ranks]
    assert all(e is not None for e in entered), ranks
    assert max(r[case]["at"] for r in ranks) - max(entered) < 10, (ranks, time.monotonic() - t0)


def test_qwenimage21_refuses_the_flex_processor_and_needs_the_prefix_fact():
    """Qwen-Image 2.1's flex processor calls flex_attention itself (it would attend the local shard only):
    refused by name; the replicated-head backend layout refuses a forward whose plan did not record the prefix."""
    import torch
    from diffusers import QwenImage21Transformer2DModel
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21FlexAttnProcessor

    from xstage_dit.features.attention_backend import AttentionContext, xstage_attention
    from xstage_dit.features.plans import plan_for
    from xstage_dit.families.sp_plan import SequenceState

    model = QwenImage21Transformer2DModel(in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
                                          num_attention_heads=2, context_in_dim=16, axes_dims_rope=(2, 2, 4))
    assert plan_for(model).family == "Qwen-Image 2.1"
    plan_for(model).build_sp(model)  # the default processor is taken
    model.transformer_blocks[1].attn.set_processor(QwenImage21FlexAttnProcessor())
    with pytest.raises(ValueError, match="got QwenImage21FlexAttnProcessor in transformer_blocks.1.attn"):
        plan_for(model).build_sp(model)

    # schedules=None: both refusals come before any schedule is looked up
    ctx = AttentionContext(group=None, rank=0, world=2, schedules=None, kv_layout="replicated_head",
                           name="transformer_blocks.0.attn", state=SequenceState(rank=0, world=2, group=None))
    q = torch.zeros(1, 3, 2, 8)
    with pytest.raises(ValueError, match=r"expected the plan to record the replicated key prefix"):
        xstage_attention(q, q, q, _parallel_config=ctx)
    ctx.state.named["kv_head"] = 2
    with pytest.raises(ValueError, match="expected keys = 2 replicated \\+ the queries' 3 sharded, got 4 keys"):
        xstage_attention(q, torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), _parallel_config=ctx)


def test_minimax_h3_plan_keeps_the_token_refiner_local():
    """The token refiner attends the whole prompt before the split: its attention is left local (diffusers'
    plan would route it through the sequence-parallel backend); every block attention is sharded; a shipped
    plan of another shape is refused by name."""
    import fnmatch
    from unittest import mock

    import torch

    from tests.helpers.minimax_h3 import build_transformer
    from xstage_dit import _diffusers_private as private
    from xstage_dit.families import minimax_h3
    from xstage_dit.features.plans import plan_for
    from xstage_dit.features.sequence_parallel import attention_modules

    model = build_transformer("tiny", dtype=torch.float32, device="meta")
    spec = plan_for(model).build_sp(model)
    local = {n for n, _ in attention_modules(model) if any(fnmatch.fnmatchcase(n, p) for p in spec.local_attention)}
    assert local == {"token_refiner.refiner_blocks.0.attn"}
    assert {n for n, _ in attention_modules(model)} - local == {"transformer_blocks.0.attn", "transformer_blocks.1.attn"}
    assert spec.cp_plan == dict(private.shipped_cp_plan(type(model)))
    broken = {k: v for k, v in private.shipped_cp_plan(type(model)).items() if k != "norm_out"}
    with mock.patch.object(private, "shipped_cp_plan", lambda cls: broken):
        with pytest.raises(ValueError, match="expected MiniMax-H3's _cp_plan to name .*got"):
            minimax_h3.sequence_plan(model)


def test_parallelize_takes_the_minimax_h3_modular_pipeline_and_its_ref2va_partition():
    """A ModularPipeline is taken like a DiffusionPipeline (its components are attributes); where only the
    ref2va partition (``transformer_ref``) is loaded, that one is patched (world 1: the attention is routed)."""
    import torch

    from tests.helpers.minimax_h3 import build
    from xstage_dit.features import parallelize

    pipe = build("tiny", dtype=torch.float32, device="cpu", seed=0)
    t2va = pipe.transformer
    with parallelize(pipe, sp=1) as handle:
        assert handle.transformers == [t2va]
    pipe.update_components(transformer_ref=t2va, transformer=None)
    assert pipe.transformer is None and pipe.transformer_ref is t2va
    before = {n: type(m.processor) for n, m in t2va.named_modules() if hasattr(m, "processor")}
    with parallelize(pipe, sp=1) as handle:
        assert handle.transformers == [t2va] and handle.transformer is t2va
        assert t2va.transformer_blocks[0].attn.processor._parallel_config is not None
    assert {n: type(m.processor) for n, m in t2va.named_modules() if hasattr(m, "processor")} == before
    assert t2va.transformer_blocks[0].attn.processor._parallel_config is None
