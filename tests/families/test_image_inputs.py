"""The image-conditioned pipelines (issue 39): FLUX.1 Kontext, img2img and Fill, FLUX.2 with references, Qwen-Image-Edit
(and Plus), Wan 2.1 / 2.2 I2V, LTX-Video I2V, CogVideoX I2V. Their records are found; each tiny pipeline under
`parallelize` at world 1, 2 and 4 (sp, and sp x cfg where the pipeline runs CFG) gives one process's output for the
same seeded input images, through the product's request type and argument policy (`family_harness.request_output`);
the full-size specs have the published dimensions.

This file is also the rank program of its multi-process cases (``python tests/families/test_image_inputs.py OUT WORLD
GROUP``, started by `xstage_dit.comm.launcher.launch` over gloo): every rank builds the same tiny pipelines, computes
the unpatched output itself, then the parallel one, restores and computes a third; each writes ``OUT.<rank>``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers.family_harness import (  # noqa: E402
    Tokens, check_parallel_ranks, equivalence, launch_ranks, request_output)
from tests.helpers.tolerances import TOL  # noqa: E402

CFG = {"negative_prompt": "blurry", "true_cfg_scale": 4.0}  # true CFG: a second transformer call a step
# (Wan's CFG runs from its default guidance_scale 5)
# model -> its cases (token counts in the comments: latent tokens + appended image tokens, per rank at world 4) and
# whether the pipeline runs CFG (then cfg=2 is tested too). Sizes that do not divide by 4 where the model allows.
MODELS = {
    # 96x64 -> 6x4 = 24 latent + 24 image tokens; two prompts share one image at 80x48 -> 15 + 15 (8, 8, 7, 7)
    "tiny-flux-kontext": ({"one": dict(prompt="make it snow", height=64, width=96, images=[(96, 64)]),
                           "two-prompts": dict(prompt=["make it snow", "a night sky"], height=48, width=80,
                                               images=[(80, 48)])}, False),
    "tiny-flux-img2img": ({"one": dict(prompt="a red fox", height=64, width=96, images=[(80, 48)])}, False),
    "tiny-flux-fill": ({"one": dict(prompt="a red fox", height=64, width=96, images=[(96, 64)], mask=True)}, False),
    # two references (FLUX.2 takes >= 64 pixels a side): 16 latent + 16 + 24 reference tokens
    "tiny-flux2": ({"refs": dict(prompt="the two in one picture", height=64, width=64,
                                 images=[(64, 64), (96, 64)])}, False),
    # Wan 2.1: 2 latent frames x 3x4 = 24 tokens, 5 CLIP image tokens in each block's cross-attention
    "tiny-wan-i2v": ({"one": dict(prompt="the fox runs", height=48, width=64, frames=5, images=[(80, 60)])}, True),
    # Wan 2.2 A14B: no image encoder, the two experts split at the boundary
    "tiny-wan22-i2v": ({"one": dict(prompt="the fox runs", height=48, width=64, frames=5, images=[(64, 48)])}, True),
    # LTX: per-token timesteps (the first frame's at 0); 2 latent frames x 2x3 = 12 tokens; two prompts, one copy
    # of the image each
    "tiny-ltx-i2v": ({"two-prompts": dict(prompt=["the fox runs", "a cat sleeps"], height=64, width=96, frames=9,
                                          images=[(96, 64)])}, False),
    "tiny-cogvideox-i2v": ({"one": dict(prompt="the fox runs", height=48, width=48, frames=5,
                                        images=[(48, 48)])}, False),
}
# Qwen-Image-Edit: the pipeline encodes its image at about 1024^2 (4144 image tokens after 12 latent ones; Plus: 4144 +
# 4096): minutes on 2 cores, so their own group
QWEN = {
    "tiny-qwenimage-edit": ({"one": dict(prompt="make it snow", height=48, width=64, images=[(64, 48)], **CFG)}, True),
    "tiny-qwenimage-edit-plus": ({"two": dict(prompt="the two together", height=48, width=64,
                                              images=[(64, 48), (48, 48)], **CFG)}, True),
}
# The image-to-video pipelines added after the first eight (their own group: the main one's world-2 run is already
# a minute). True CFG where the pipeline has it (a second transformer call a step: cfg=2 is tested).
VIDEO = {
    # HunyuanVideo-I2V: 4 image tokens before the prompt's; 3 latent frames x 4x6 = 72 tokens, of which the first
    # frame's 24 are modulated apart: at sp=2 rank 0 holds them and 12 others, at sp=4 ranks 0 and 1 share them (18 + 6)
    "tiny-hunyuanvideo-i2v": ({"one": dict(prompt="the fox runs", height=32, width=48, frames=9, images=[(64, 40)],
                                           **CFG)}, True),
    # Wan 2.1 FLF2V: the first and the last frame's latents on channels, both images' 2 x 17 CLIP tokens (with their
    # position embedding) in each block's cross-attention; 2 latent frames x 3x4 = 24 tokens; two prompts share them
    "tiny-wan-flf2v": ({"two-prompts": dict(prompt=["the fox runs", "a cat sleeps"], height=48, width=64, frames=5,
                                            images=[(80, 60), (64, 48)])}, True),
    # HunyuanVideo 1.5 I2V: the image's latents on channels, its 9 SigLIP tokens at the front of the reordered text;
    # the pipeline sizes the video (a 5:3 image: 80x48, 2 latent frames x 3x5 = 30 tokens, 8 + 8 + 7 + 7 at sp=4).
    # One prompt: its VAE decodes one video a call (diffusers 0.42.1's mid-block mask breaks a batch); CFG is the
    # guider's (no cfg=2)
    "tiny-hunyuanvideo15-i2v": ({"one": dict(prompt="the fox runs", height=48, width=80, frames=5,
                                             images=[(100, 60)])}, False),
    # LTX-Video's condition pipeline, an image at frame 0: its latents replace the first latent frame, whose tokens
    # get timestep 0 (per-token timesteps), with the pipeline's own video coordinates; 2 x 2x3 = 12 tokens
    "tiny-ltx-condition": ({"one": dict(prompt="the fox runs", height=64, width=96, frames=9,
                                        images=[(80, 60)])}, False),
    # LTX-2: the first latent frame is the image's (H.264 round trip first), per-token video timesteps beside the
    # audio's; 3 latent frames x 16x16 = 768 video tokens, the audio stream whole on every rank
    "tiny-ltx2-i2v": ({"one": dict(prompt="the fox runs", height=32, width=32, frames=5, images=[(48, 40)])}, False),
    # SkyReels-V2 I2V: Wan 2.1 I2V's scheme on its transformer (no CFG parallel in its record); 2 x 3x4 = 24 tokens
    "tiny-skyreels-v2-i2v": ({"two-prompts": dict(prompt=["the fox runs", "a cat sleeps"], height=48, width=64,
                                                  frames=5, images=[(80, 60)])}, False),
}
GROUPS = {"main": MODELS, "qwen": QWEN, "video": VIDEO}
# The pixel area the Qwen-Image edits resize each input image to for their VAE (and Edit's for its text encoder too),
# per world: diffusers' own ~1024^2 at world 1 (`test_world_1_matches_the_unpatched_pipeline`: the pipeline as
# diffusers has it, 4144 appended image tokens); under sequence parallelism (worlds 2 and 4, every rank encoding the
# images at every call, ranks sharing the 2-core CI machine) 256^2: 252 (+ 256) appended image tokens, still sharded
# with the 12 latent ones across every rank (264 and 520 in all, a shard each), for a sixteenth of the VAE's work.
QWEN_VAE_AREA = {2: 256 * 256, 4: 256 * 256}
# diffusers 0.42.1's pipeline_qwenimage_edit(_plus): the target area of calculate_dimensions
PIPELINE_VAE_AREA = 1024 * 1024


@contextlib.contextmanager
def qwen_vae_area(area: int | None):
    """Within: the Qwen-Image edit pipelines size their input images' VAE encodes (and Edit's text-encoder image) to
    about `area` pixels instead of diffusers' 1024^2; the reference and the parallel run both see it. None: as
    diffusers has it. (Their ``__call__`` takes no such argument: the area is a literal / module constant.)"""
    if area is None:
        yield
        return
    from unittest import mock

    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit, pipeline_qwenimage_edit_plus as plus

    def scaled(original):
        return lambda target_area, ratio: original(area if target_area == PIPELINE_VAE_AREA else target_area, ratio)

    assert plus.VAE_IMAGE_SIZE == PIPELINE_VAE_AREA, plus.VAE_IMAGE_SIZE  # diffusers changed: revisit the patch
    with mock.patch.object(edit, "calculate_dimensions", scaled(edit.calculate_dimensions)), \
            mock.patch.object(plus, "calculate_dimensions", scaled(plus.calculate_dimensions)):
        yield


def configs(world: int, cfg: bool) -> dict[str, dict]:
    if world == 2:
        return {"sp2": dict(sp=2), **({"cfg2": dict(cfg=2)} if cfg else {})}
    return {"sp4": dict(sp=4), **({"sp2-cfg2": dict(sp=2, cfg=2)} if cfg else {})}


def four_heads(pipe) -> None:
    """World 4: a tiny transformer of 2 heads (FLUX.1, Wan) rebuilt with 4 (random weights, the same config
    otherwise), so that sp=4 gives every rank a head, as tests/features/test_parallelize.py does for FLUX."""
    from xstage_dit.families.build import build_module

    for name in ("transformer", "transformer_2"):
        model = getattr(pipe, name, None)
        if model is None or model.config.num_attention_heads >= 4:
            continue
        config = dict(model.config, num_attention_heads=4)
        if config.get("added_kv_proj_dim"):  # Wan 2.1 I2V: the image key/value projections are as wide
            config["added_kv_proj_dim"] = 4 * config["attention_head_dim"]
        setattr(pipe, name, build_module(lambda: type(model).from_config(config), seed=0, device="cpu",
                                         dtype=torch.float32))


def rank_main(out: str, world: int, group: str) -> int:
    from xstage_dit.comm.distributed import close_distributed, init_distributed
    from xstage_dit.families import load_pipeline

    info = init_distributed(backend="gloo", timeout_s=300)
    torch.set_num_threads(1)
    results = {}
    stack = contextlib.ExitStack()
    if group == "qwen":
        stack.enter_context(qwen_vae_area(QWEN_VAE_AREA.get(world)))
    for model, (cases, cfg) in GROUPS[group].items():
        pipe = load_pipeline(model, seed=0)
        if world == 4:
            four_heads(pipe)
        for case_name, case in cases.items():
            with Tokens(pipe.transformer) as tokens:
                ref = request_output(pipe, model, case)
            results[f"{model}/{case_name}/single-tokens"] = sum(tokens)
            for config_name, config in configs(world, cfg).items():
                results[f"{model}/{case_name}/{config_name}"] = equivalence(
                    pipe, config, lambda: request_output(pipe, model, case), ref)
        del pipe
    stack.close()
    Path(f"{out}.{info.rank}").write_text(json.dumps(results))
    close_distributed()
    return 0


def _check(ranks: list[dict], world: int, group: str) -> None:
    check_parallel_ranks(ranks, world, {f"{model}/{case_name}": configs(world, cfg)
                                        for model, (cases, cfg) in GROUPS[group].items() for case_name in cases})


# ------------------------------------------------------------------------------------------------------- tests


def test_the_records_name_the_image_pipelines():
    from xstage_dit.families import model_spec
    from xstage_dit.families.registry import image_inputs_for, record_for_pipeline, supported_pipelines

    for model in (*MODELS, *QWEN, *VIDEO):
        spec = model_spec(model)
        assert record_for_pipeline(spec.pipeline_class).name == spec.family
        assert supported_pipelines()[spec.pipeline_class] == spec.family  # a local folder of it is served
        assert image_inputs_for(spec.pipeline_class) is not None, model
    assert image_inputs_for("FluxPipeline") is None and image_inputs_for("WanPipeline") is None


@pytest.mark.parametrize("group", ["main", "video", pytest.param("qwen", marks=pytest.mark.slow)])
def test_world_1_matches_the_unpatched_pipeline(group):
    from xstage_dit.families import load_pipeline

    for model, (cases, _) in GROUPS[group].items():
        pipe = load_pipeline(model, seed=0)
        for case in cases.values():
            ref = request_output(pipe, model, case)
            result = equivalence(pipe, {}, lambda: request_output(pipe, model, case), ref)
            assert result["ref_std"] > 1e-3 and result["max_abs"] <= TOL.fp32_pipeline, (model, result)
            assert result["restored"] == 0, (model, result)


# world 2 of the main group runs ~60 s on the 2-core CI machine (eight pipelines, three runs a config)
@pytest.mark.slow
@pytest.mark.parametrize("world, group", [(2, "main"), (4, "main"), (2, "qwen"), (4, "qwen"), (2, "video"),
                                          (4, "video")])
def test_parallel_pipeline_matches_one_process(world, group, tmp_path):
    _check(launch_ranks(__file__, f"images-{group}", world, tmp_path, group, timeout_s=1200), world, group)


def test_kontext_shards_the_appended_image_tokens():
    """Kontext's image tokens go into the sequence: at sp=2 every attention projects fewer queries than at world 1
    (the appended tokens are sharded, not replicated) -- checked at world 2 by the slow test; here the sequence
    the transformer sees holds latent + image tokens."""
    from xstage_dit.families import load_pipeline

    pipe = load_pipeline("tiny-flux-kontext", seed=0)
    seen = []
    handle = pipe.transformer.register_forward_pre_hook(lambda m, a, k: seen.append(k["hidden_states"].shape[1]),
                                                        with_kwargs=True)
    try:
        request_output(pipe, "tiny-flux-kontext", MODELS["tiny-flux-kontext"][0]["one"])
    finally:
        handle.remove()
    assert seen and set(seen) == {24 + 24}, seen


def test_full_kontext_and_wan_i2v_have_the_published_dimensions():
    """FLUX.1-Kontext-dev: the FLUX.1-dev transformer (11.9B); Wan2.1-I2V-14B-480P: 36 input channels, CLIP
    ViT-H/14 image tokens (image_dim 1280) read by key/value projections of their own in each of the 40 blocks."""
    from xstage_dit.families import load_pipeline, load_transformer

    kontext = load_pipeline("full-flux-kontext", dtype=torch.bfloat16, device="meta")
    assert type(kontext).__name__ == "FluxKontextPipeline"
    billions = sum(p.numel() for p in kontext.transformer.parameters()) / 1e9
    assert billions == pytest.approx(11.9, rel=0.01), billions
    wan = load_pipeline("full-wan-i2v", dtype=torch.bfloat16, device="meta")
    config = wan.transformer.config
    published = dict(added_kv_proj_dim=5120, attention_head_dim=128, ffn_dim=13824, image_dim=1280, in_channels=36,
                     num_attention_heads=40, num_layers=40, out_channels=16, text_dim=4096)
    assert {k: config[k] for k in published} == published
    assert wan.image_encoder.config.hidden_size == 1280 and wan.image_encoder.config.num_hidden_layers == 32
    assert load_transformer("full-wan-i2v", device="meta").config.in_channels == 36


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
