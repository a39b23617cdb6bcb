"""One rank of the family tests (spawned by tests/features/test_families*.py via xstage_dit.comm.launcher).

Equivalence cases: every rank builds the same tiny pipeline (same seed) and parallelizes it (sp = world); rank 0
computes the single-process output first, generates again in parallel with the others, restores and generates a
third time, and its JSON holds the differences. The tests read rank 0's equivalence results only, so the other
ranks run only the parallel call and write what it gives (one-process runs of theirs would be CPU spent for
nothing: four ranks share the 2-core CI machine).
Failure cases: every rank records which error it ended with and how long it took.
Every rank writes its own JSON (``OUT.<rank>``). XSTAGE_TEST_DEVICE / XSTAGE_TEST_DTYPE (default cpu,
float32) select where the pipelines are built (the GPU test: cuda, bfloat16).

    python tests/features/_families_worker.py OUT CASE [CASE ...]
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

PROMPT = "a red fox in the snow"


def _gen(seed=0):
    return torch.Generator("cpu").manual_seed(seed)


def _video(frames: int, h: int, w: int, seed: int = 3):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for _ in range(frames)]


def _mask(frames: int, h: int, w: int):
    from PIL import Image

    m = np.zeros((h, w), dtype=np.uint8)
    m[:, w // 2:] = 255  # regenerate the right half, keep the left half of the control video
    return [Image.fromarray(m) for _ in range(frames)]


# The GPU test runs the same cases in bf16 on ranks sharing one GPU (tests/features/test_families_gpu.py).
DEVICE = os.environ.get("XSTAGE_TEST_DEVICE", "cpu")
DTYPE = getattr(torch, os.environ.get("XSTAGE_TEST_DTYPE", "float32"))


def _hunyuan_template():
    from xstage_dit.families.hunyuan_video import PROMPT_TEMPLATE

    return PROMPT_TEMPLATE


def _chronoedit_pipe():
    from tests.helpers import chronoedit

    pipe = chronoedit.build("tiny", dtype=DTYPE, device=DEVICE, seed=0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipe(name):
    from xstage_dit.families import load_pipeline

    return load_pipeline(name, seed=0, dtype=DTYPE, device=DEVICE)


def _minimax_h3_pipe():
    from tests.helpers import minimax_h3

    pipe = minimax_h3.build("tiny", dtype=DTYPE, device=DEVICE, seed=0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _hunyuan_image_distilled_pipe():
    from xstage_dit.families import hunyuan_image

    pipe = hunyuan_image.build("tiny", dtype=DTYPE, device=DEVICE, seed=0, distilled=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


GLYPH_PROMPT = 'a shop sign that says "open"'  # quoted text: the ByT5 glyph tokens of the Hunyuan pipelines


# name -> (build, call kwargs). Sizes give token counts that do not divide by 4 where the family allows
# (the gather-KV path), and the masks, CFG batches and conditioning the pipelines really pass.
PIPELINES = {
    # 64x96x9 -> 2x3x2 = 12 video tokens, 16 padded text tokens with a (batch, heads, 1, text) mask, CFG batch 2
    "ltx": (lambda: _pipe("tiny-ltx"), dict(prompt=PROMPT, negative_prompt="blurry", height=64, width=96, num_frames=9,
                                            num_inference_steps=2, guidance_scale=3.0, max_sequence_length=16)),
    # 48x48x5 -> 2 latent frames x 3x3 = 18 video tokens (rotary), 16 text, CFG batch 2
    "cogvideox": (lambda: _pipe("tiny-cogvideox"), dict(prompt=PROMPT, height=48, width=48, num_frames=5,
                                                        num_inference_steps=2, guidance_scale=6.0,
                                                        max_sequence_length=16)),
    # 48x48 -> 9 image tokens, 77 CLIP + 16 T5 text tokens, CFG batch 2
    "sd3": (lambda: _pipe("tiny-sd3"), dict(prompt=PROMPT, height=48, width=48, num_inference_steps=2,
                                            guidance_scale=7.0, max_sequence_length=16)),
    # unified [image, caption] sequence padded to multiples of 32 with its key mask; 6 heads at sp=4
    "z-image": (lambda: _pipe("tiny-z-image"), dict(prompt=PROMPT, height=64, width=64, num_inference_steps=2,
                                                    guidance_scale=0.0, max_sequence_length=32)),
    # control video + mask: VACE hints on every block; 2 latent frames x 4x4 = 32 tokens
    "wan-vace": (lambda: _pipe("tiny-wan-vace"), dict(prompt=PROMPT, video=_video(5, 64, 64), mask=_mask(5, 64, 64),
                                                      height=64, width=64, num_frames=5, num_inference_steps=2,
                                                      guidance_scale=1.0, max_sequence_length=16)),
    # diffusion forcing: per-frame timesteps (per-token modulation); 2 latent frames x 3x3 = 18 tokens
    "skyreels-v2": (lambda: _pipe("tiny-skyreels-v2"), dict(prompt=PROMPT, height=48, width=48, num_frames=5,
                                                            num_inference_steps=2, guidance_scale=1.0,
                                                            max_sequence_length=16, ar_step=0, causal_block_size=1)),
    # true CFG (cond and uncond prompts of different lengths, each with its mask); 48x48 -> 9 image tokens
    "qwenimage": (lambda: _pipe("tiny-qwenimage"), dict(prompt=PROMPT, negative_prompt="blurry", true_cfg_scale=4.0,
                                                        height=48, width=48, num_inference_steps=2,
                                                        max_sequence_length=64)),
    # HunyuanVideo: 32x32x5 -> 2 latent frames x 4x4 = 32 video tokens, 16 padded Llama tokens with their mask
    # (the template cropped), the CLIP pooled prompt, embedded guidance and true CFG (a second call per step)
    "hunyuanvideo": (lambda: _pipe("tiny-hunyuanvideo"), dict(prompt=PROMPT, negative_prompt="blurry", true_cfg_scale=4.0,
                                                              height=32, width=32, num_frames=5, num_inference_steps=2,
                                                              guidance_scale=6.0, max_sequence_length=16,
                                                              prompt_template=_hunyuan_template())),
    # LTX-2, audio + video: 32x32x5 -> 3 latent frames x 4x4 = 48 video tokens, 5 audio tokens (whole on every
    # rank), 16 padded Gemma tokens with their mask; CFG as a (uncond, cond) batch, then the STG call (block 0
    # perturbed) and the modality-isolation call (no audio<->video attention) per step
    "ltx2": (lambda: _pipe("tiny-ltx2"), dict(prompt=PROMPT, negative_prompt="blurry", height=32, width=32, num_frames=5,
                                              frame_rate=24.0, num_inference_steps=2, guidance_scale=3.0,
                                              max_sequence_length=16, spatio_temporal_guidance_blocks=[0])),
    # Qwen-Image 2.1: two prompts of different lengths (the padding mask), true CFG as two calls, the KV cache
    # (prefill on step 0, target-only decode after); 64x96 -> 4x6 = 24 target tokens after a 22-token prefix
    "qwenimage21": (lambda: _pipe("tiny-qwenimage21"), dict(prompt=[PROMPT, "a cat"], negative_prompt=["blurry", "dark"],
                                                            true_cfg_scale=4.0, height=64, width=96,
                                                            num_inference_steps=2)),
    # one prompt, no mask, no cache: every step prefills the block-causal segments; 64x64 -> 16 target tokens
    "qwenimage21-nocache": (lambda: _pipe("tiny-qwenimage21"), dict(prompt=PROMPT, height=64, width=64,
                                                                    num_inference_steps=2, use_kv_cache=False)),
    # 48x48 -> 3x3 = 9 image tokens (3, 2, 2, 2 at world 4), 32 padded text tokens from the chat template
    "flux2": (lambda: _pipe("tiny-flux2"), dict(prompt=PROMPT, height=48, width=48, num_inference_steps=2,
                                                guidance_scale=4.0, max_sequence_length=32,
                                                text_encoder_out_layers=(1, 2, 3))),
    # Helios with 3 blocks (its plan follows the model, not diffusers' 40): a window of latent frames with
    # its history latents, guidance 5 (two calls per step)
    "helios": (lambda: _pipe("tiny-helios"), dict(prompt=PROMPT, negative_prompt="blurry", height=48, width=48,
                                                  num_frames=9, num_inference_steps=2, guidance_scale=5.0,
                                                  max_sequence_length=16)),
    # image-conditioned: CLIP vision embeddings in the cross-attention, the image latents as channels
    "chronoedit": (_chronoedit_pipe, dict(image=_video(1, 48, 48)[0], prompt=PROMPT, negative_prompt="blurry", height=48,
                                          width=48, num_frames=5, num_inference_steps=2, guidance_scale=5.0,
                                          max_sequence_length=16)),
    # HunyuanVideo 1.5: 28x28x9 -> 3 latent frames x 7x7 = 147 video tokens (odd: uneven at 2 and 4); per prompt
    # [9 zero-masked image, 16 ByT5, 24 Qwen2.5-VL] = 49 text tokens reordered valid-first with one (batch, text)
    # mask; CFG by the pipeline's guider, two calls per step: the prompt quotes text (valid ByT5 tokens), the
    # negative one does not (an all-zero ByT5 mask). One video: diffusers 0.42.1's HunyuanVideo 1.5 VAE cannot
    # decode a batch of 2 (its mid-block attention mask, (batch, S, S), broadcasts to (batch, batch, S, S))
    "hunyuanvideo15": (lambda: _pipe("tiny-hunyuanvideo15"), dict(prompt=GLYPH_PROMPT, negative_prompt="blurry",
                                                                  height=28, width=28, num_frames=9,
                                                                  num_inference_steps=2)),
    # HunyuanImage 2.1: 40x56 -> 10x14 = 140 image tokens, [16 ByT5, 25 Qwen2.5-VL] = 41 text tokens (uneven at 2
    # and 4) with the (batch, 1, 1, keys) mask; a glyph prompt and a plain one: the ocr guider (APG), two calls
    "hunyuanimage": (lambda: _pipe("tiny-hunyuanimage"), dict(prompt=[GLYPH_PROMPT, PROMPT], negative_prompt=["blurry", "dark"],
                                                              height=40, width=56, num_inference_steps=2)),
    # the distilled variant: guidance and MeanFlow timestep_r embedded, no guider (one call per step); 40x40 ->
    # 100 image tokens
    "hunyuanimage-distilled": (_hunyuan_image_distilled_pipe, dict(prompt=GLYPH_PROMPT, height=40, width=40,
                                                                   num_inference_steps=2,
                                                                   distilled_guidance_scale=3.25)),
    # MiniMax-H3 (modular pipeline, t2va): 16x24 x 124 frames (the shortest video it makes: 5 s at 24 fps) -> one
    # packed sequence of 7 text + 414 stereo audio rows (207 latents x 2) + 37 latent frames x 2x3 = 222 video rows
    # = 643 rows (odd: uneven at 2 and 4); 3 sigma points = 2 calls, one per step, batch 1 (guidance-distilled: no
    # CFG); the pixels and the stereo waveform are compared
    "minimax-h3": (_minimax_h3_pipe, dict(prompt=PROMPT, height=16, width=24, num_frames=124, num_inference_steps=3,
                                          output=["videos", "audio"])),
    # causal blocks of 2 latent frames: a (1, 1, seq, seq) block-causal mask whose query rows follow the shards
    "skyreels-v2-causal": (lambda: _pipe("tiny-skyreels-v2"), dict(prompt=PROMPT, height=48, width=48, num_frames=13,
                                                                   num_inference_steps=2, guidance_scale=1.0,
                                                                   max_sequence_length=16, ar_step=0,
                                                                   causal_block_size=2)),
}


def _qwenimage():
    """QwenImage transformer on the inputs its pipeline makes: 48x48 -> 9 image tokens (3, 2, 2, 2 at
    world 4: the shard that used to be empty), a 7-token prompt with its padding mask, batch 2."""
    from diffusers import QwenImageTransformer2DModel

    from xstage_dit.families.build import build_module

    model = build_module(lambda: QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=4,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6)), seed=1, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0  # the second prompt is shorter: padded
    return model, dict(hidden_states=torch.randn(2, 9, 16, generator=g), encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
                       encoder_hidden_states_mask=mask, timestep=torch.tensor([0.5, 0.5]), img_shapes=[[(1, 3, 3)]] * 2,
                       return_dict=False)


def _hunyuan_video():
    """HunyuanVideo transformer: 1 frame x 3x3 patches = 9 video tokens, 12 text tokens padded after 9."""
    from tests.helpers.tiny_transformers import hunyuan_video_transformer

    model = hunyuan_video_transformer()
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(1, 12)
    mask[:, 9:] = 0
    return model, dict(hidden_states=torch.randn(1, 4, 1, 6, 6, generator=g), timestep=torch.tensor([500]),
                       encoder_hidden_states=torch.randn(1, 12, 32, generator=g), encoder_attention_mask=mask,
                       pooled_projections=torch.randn(1, 32, generator=g), guidance=torch.tensor([3500.0]),
                       return_dict=False)


def _helios(num_layers=3):
    """Helios with 3 blocks (diffusers' own plan names exactly 40): 2 frames x 3x3 = 18 video tokens."""
    from diffusers import HeliosTransformer3DModel

    from xstage_dit.families.build import build_module

    model = build_module(lambda: HeliosTransformer3DModel(
        num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=16, freq_dim=16,
        ffn_dim=32, num_layers=num_layers, rope_dim=(4, 6, 6)), seed=1, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    return model, dict(hidden_states=torch.randn(1, 4, 2, 6, 6, generator=g), timestep=torch.tensor([500]),
                       encoder_hidden_states=torch.randn(1, 7, 16, generator=g), return_dict=False)


def _ltx2():
    """LTX-2 (audio + video), 2 frames x 2x3 = 12 video and 5 audio tokens, 7 text tokens with a padded
    prompt in a CFG-style batch of 2 (the text masks its pipeline passes)."""
    from diffusers import LTX2VideoTransformer3DModel

    from xstage_dit.families.build import build_module

    model = build_module(lambda: LTX2VideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=8, cross_attention_dim=32,
        audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=4, audio_attention_head_dim=8,
        audio_cross_attention_dim=32, num_layers=1, caption_channels=32), seed=1, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, 7)
    mask[1, 4:] = 0
    return model, dict(hidden_states=torch.randn(2, 12, 8, generator=g), audio_hidden_states=torch.randn(2, 5, 8, generator=g),
                       encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
                       audio_encoder_hidden_states=torch.randn(2, 7, 32, generator=g), timestep=torch.tensor([500.0, 500.0]),
                       encoder_attention_mask=mask, audio_encoder_attention_mask=mask, num_frames=2, height=2, width=3,
                       audio_num_frames=5, return_dict=False)


def _flux2():
    """FLUX.2: 3x3 = 9 image tokens (an empty shard at world 4 under the old rule), 5 text tokens."""
    from diffusers import Flux2Transformer2DModel

    from xstage_dit.families.build import build_module

    model = build_module(lambda: Flux2Transformer2DModel(
        in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=4,
        joint_attention_dim=32, timestep_guidance_channels=16, axes_dims_rope=(4, 4, 4, 4)), seed=1, device="cpu",
        dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    img_ids = torch.zeros(1, 9, 4)
    img_ids[0, :, 1], img_ids[0, :, 2] = torch.arange(9) // 3, torch.arange(9) % 3
    txt_ids = torch.zeros(1, 5, 4)
    txt_ids[0, :, 3] = torch.arange(5)
    return model, dict(hidden_states=torch.randn(1, 9, 8, generator=g), encoder_hidden_states=torch.randn(1, 5, 32, generator=g),
                       timestep=torch.tensor([0.5]), img_ids=img_ids, txt_ids=txt_ids, guidance=torch.tensor([3.5]),
                       return_dict=False)


def _chronoedit():
    """ChronoEdit (Wan-style video editing): 2 frames x 3x3 = 18 video tokens, 7 text tokens."""
    from diffusers import ChronoEditTransformer3DModel

    from xstage_dit.families.build import build_module

    model = build_module(lambda: ChronoEditTransformer3DModel(
        num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=16, freq_dim=16,
        ffn_dim=32, num_layers=2, rope_max_seq_len=64), seed=1, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    return model, dict(hidden_states=torch.randn(1, 4, 2, 6, 6, generator=g), timestep=torch.tensor([500]),
                       encoder_hidden_states=torch.randn(1, 7, 16, generator=g), return_dict=False)


def _hunyuan_image():
    """HunyuanImage 2.1 (dual + single blocks, token refiner): 3x3 = 9 image tokens, 8 text tokens of
    which the second prompt pads 3, batch 2."""
    from diffusers import HunyuanImageTransformer2DModel

    from xstage_dit.families.build import build_module

    model = build_module(lambda: HunyuanImageTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=1, num_single_layers=1,
        num_refiner_layers=1, text_embed_dim=32, rope_axes_dim=(8, 8)), seed=1, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    return model, dict(hidden_states=torch.randn(2, 4, 3, 3, generator=g), timestep=torch.tensor([500.0, 500.0]),
                       encoder_hidden_states=torch.randn(2, 8, 32, generator=g), encoder_attention_mask=mask,
                       return_dict=False)


def _hunyuan_video15():
    """HunyuanVideo 1.5 (T2V inputs as its pipeline makes them: LLM and ByT5 prompts with padding masks,
    zero image embeddings with a zero mask): 2 frames x 3x3 = 18 video tokens, batch 2."""
    from diffusers import HunyuanVideo15Transformer3DModel

    from xstage_dit.families.build import build_module

    model = build_module(lambda: HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=2, num_refiner_layers=1,
        text_embed_dim=32, text_embed_2_dim=16, image_embed_dim=16, rope_axes_dim=(4, 6, 6), task_type="t2v"),
        seed=1, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    mask, mask_2 = torch.ones(2, 8), torch.ones(2, 4)
    mask[1, 5:] = 0
    mask_2[0, 3:] = 0
    return model, dict(hidden_states=torch.randn(2, 9, 2, 3, 3, generator=g), timestep=torch.tensor([500.0, 500.0]),
                       encoder_hidden_states=torch.randn(2, 8, 32, generator=g), encoder_attention_mask=mask,
                       encoder_hidden_states_2=torch.randn(2, 4, 16, generator=g), encoder_attention_mask_2=mask_2,
                       image_embeds=torch.zeros(2, 3, 16), return_dict=False)


def _minimax_h3():
    """MiniMax-H3 on the fl2va layout its layout step builds (`build_packed_sequence`): 7 text rows, one "first"
    keyframe's 2x3 conditioning rows, 5 audio latents x 2 channels and 2 latent frames x 2x3 video rows = 35
    rows (uneven at 2 and 4), three distinct timesteps (keyframe, audio, video), batch 2 (the batch axis
    replicates the layout)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    from tests.helpers.minimax_h3 import build_transformer

    model = build_transformer("tiny", dtype=torch.float32, device="cpu", seed=1)
    tags = torch.full((7,), 1, dtype=torch.long)
    position_ids, token_tags, video_idx, audio_idx, text_idx, cond_rows, _ = \
        MiniMaxH3PrepareLayoutStep.build_packed_sequence(tags, num_latent_frames=2, latent_height=4, latent_width=6,
                                                         num_audio_latents=5, patch_size=(1, 2, 2), audio_channels=2,
                                                         audio_tag=2, video_tag=0, keyframe_anchors=("first",))
    timestep_indices = torch.zeros(position_ids.shape[0], dtype=torch.long)  # text and the keyframe: t = 0.999
    timestep_indices[audio_idx] = 1
    timestep_indices[video_idx[cond_rows:]] = 2
    g = torch.Generator().manual_seed(0)
    return model, dict(hidden_states=torch.randn(2, len(video_idx), 16, generator=g),
                       audio_hidden_states=torch.randn(2, len(audio_idx), 4, generator=g),
                       encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
                       timestep=torch.tensor([0.999, 0.6, 0.3]), timestep_indices=timestep_indices, token_tags=token_tags,
                       position_ids=position_ids, video_indices=video_idx, audio_indices=audio_idx,
                       text_indices=text_idx, return_dict=False)


# Transformers called on pipeline-shaped inputs the pipeline cases do not reach (tests/features/test_families.py).
# Named apart from PIPELINES (by their token counts): `main` looks a name up in PIPELINES first.
TRANSFORMERS = {"qwenimage-9": _qwenimage, "hunyuanvideo-9": _hunyuan_video, "helios-3-blocks": _helios,
                "ltx2-12": _ltx2, "flux2-9": _flux2, "chronoedit-18": _chronoedit, "hunyuanimage-9": _hunyuan_image,
                "hunyuanvideo15-18": _hunyuan_video15, "minimax-h3-35": _minimax_h3}
if set(TRANSFORMERS) & set(PIPELINES):
    raise ValueError(f"expected case names unique to one table, got {sorted(set(TRANSFORMERS) & set(PIPELINES))} in both")


def transformer_equivalence(name: str, world: int, reference: bool = True) -> dict:
    from xstage_dit.features import ParallelConfig, parallelize

    model, inputs = TRANSFORMERS[name]()
    with torch.no_grad():
        if not reference:  # a rank whose results no test reads (the module docstring): the parallel call only
            with parallelize(model, ParallelConfig(sp=world)):
                par = torch.cat([o.flatten() for o in model(**inputs)])
            return {"finite": bool(torch.isfinite(par).all())}
        # every output (LTX-2 returns the video and the audio), flattened into one vector
        with _longest_attention_sequence(model) as ref_tokens:
            ref = torch.cat([o.flatten() for o in model(**inputs)])
        with parallelize(model, ParallelConfig(sp=world)), _longest_attention_sequence(model) as par_tokens:
            par = torch.cat([o.flatten() for o in model(**inputs)])
    return {"max_abs_parallel": float((par - ref).abs().max()), "finite": bool(torch.isfinite(par).all()),
            "ref_std": float(ref.std()), "shape": list(ref.shape), "tokens_single": sum(ref_tokens),
            "tokens_parallel": sum(par_tokens)}


def _output(pipe, kwargs, generator=None) -> np.ndarray:
    """The pixels (and, for LTX-2 and MiniMax-H3, the waveform after them), flattened when there is audio.
    A modular pipeline (MiniMax-H3), called with ``output=[...]``, returns a plain dict of those outputs (a
    classic pipeline's BaseOutput is a dict too, with ``.images`` / ``.frames``)."""
    out = pipe(**kwargs, generator=generator or _gen(), output_type="np")
    if type(out) is dict:
        arr, audio = np.asarray(out["videos"], dtype=np.float32), out.get("audio")
    else:
        arr = np.asarray(out.frames if hasattr(out, "frames") else out.images, dtype=np.float32)
        audio = getattr(out, "audio", None)
    if isinstance(audio, torch.Tensor):  # MiniMax-H3 returns the waveform as a tensor on the pipeline's device
        audio = audio.float().cpu().numpy()
    if audio is not None:
        return np.concatenate([arr.ravel(), np.asarray(audio, dtype=np.float32).ravel()])
    return arr


def equivalence(name: str, world: int, reference: bool = True) -> dict:
    from xstage_dit.features import ParallelConfig, parallelize

    build, kwargs = PIPELINES[name]
    t0 = time.perf_counter()
    pipe = build()
    pipe.set_progress_bar_config(disable=True)
    if not reference:  # a rank whose results no test reads (the module docstring): the parallel call only
        with parallelize(pipe, ParallelConfig(sp=world)):
            par = _output(pipe, kwargs)
        return {"finite": bool(np.isfinite(par).all()), "seconds": time.perf_counter() - t0}
    with _longest_attention_sequence(pipe.transformer) as ref_tokens:
        ref = _output(pipe, kwargs)
    handle = parallelize(pipe, ParallelConfig(sp=world))
    with _longest_attention_sequence(pipe.transformer) as par_tokens:
        par = _output(pipe, kwargs)
    handle.restore()
    back = _output(pipe, kwargs)
    return {
        "max_abs_parallel": float(np.abs(par - ref).max()),
        "mean_abs_parallel": float(np.abs(par - ref).mean()),
        "max_abs_restored": float(np.abs(back - ref).max()),
        "finite": bool(np.isfinite(par).all()),
        "shape": list(ref.shape),
        "ref_std": float(ref.std()),
        # query tokens summed over every attention call: fewer in parallel = the split really ran
        "tokens_single": sum(ref_tokens),
        "tokens_parallel": sum(par_tokens),
        "seconds": time.perf_counter() - t0,
    }


class _longest_attention_sequence:
    """Records the tokens every attention's query projection (``to_q``) is applied to: a test-side forward
    pre-hook on the projection, which runs after the split hooks of the attention module itself (Helios)."""

    def __init__(self, model):
        self.modules = [m.to_q for m in model.modules()
                        if getattr(m, "processor", None) is not None and isinstance(getattr(m, "to_q", None), torch.nn.Module)]
        self.seen: list[int] = []
        self.handles = []

    def __enter__(self):
        def pre(module, args):
            if args and isinstance(args[0], torch.Tensor) and args[0].dim() == 3:
                self.seen.append(args[0].shape[1])
        self.handles = [m.register_forward_pre_hook(pre) for m in self.modules]
        return self.seen

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _flux(heads=4):
    from xstage_dit.families import load_pipeline
    from xstage_dit.families.build import build_module

    pipe = load_pipeline("tiny-flux", seed=0)
    cfg = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}
    cfg["num_attention_heads"] = heads
    pipe.transformer = build_module(lambda: type(pipe.transformer).from_config(cfg), seed=1, device="cpu",
                                    dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


FLUX_CALL = dict(prompt=PROMPT, height=48, width=48, num_inference_steps=2, max_sequence_length=8, guidance_scale=3.5)


def subclass(world: int, reference: bool = True) -> dict:
    """A user's subclass of FluxTransformer2DModel resolves to the FLUX.1 plan."""
    from diffusers import FluxTransformer2DModel

    from xstage_dit.features import ParallelConfig, parallelize

    class MyFlux(FluxTransformer2DModel):
        pass

    pipe = _flux()
    ref = _output(pipe, FLUX_CALL) if reference else None
    original = pipe.transformer
    pipe.transformer = MyFlux.from_config(original.config)
    pipe.transformer.load_state_dict(original.state_dict())
    pipe.transformer.eval()
    with parallelize(pipe, ParallelConfig(sp=world)):
        par = _output(pipe, FLUX_CALL)
    if ref is None:
        return {"finite": bool(np.isfinite(par).all())}
    return {"max_abs_parallel": float(np.abs(par - ref).max()), "finite": bool(np.isfinite(par).all()),
            "ref_std": float(ref.std())}


# ------------------------------------------------------------------------------------------ failure cases


def _bypassing_processor():
    import torch.nn.functional as F
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, _get_qkv_projections
    from diffusers.models.embeddings import apply_rotary_emb

    class SDPAFluxProcessor(FluxAttnProcessor):
        """Calls torch's SDPA itself: under sequence parallelism it would attend only the local shard."""

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                     image_rotary_emb=None):
            q, k, v, eq, ek, ev = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
            q, k, v = (t.unflatten(-1, (attn.heads, -1)) for t in (q, k, v))
            q, k = attn.norm_q(q), attn.norm_k(k)
            if attn.added_kv_proj_dim is not None:
                eq, ek, ev = (t.unflatten(-1, (attn.heads, -1)) for t in (eq, ek, ev))
                eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
                q, k, v = torch.cat([eq, q], 1), torch.cat([ek, k], 1), torch.cat([ev, v], 1)
            if image_rotary_emb is not None:
                q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
                k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            out = out.transpose(1, 2).flatten(2, 3).to(q.dtype)
            if encoder_hidden_states is not None:
                eo, out = out.split_with_sizes([encoder_hidden_states.shape[1], out.shape[1] - encoder_hidden_states.shape[1]], dim=1)
                return attn.to_out[1](attn.to_out[0](out)), attn.to_add_out(eo)
            return out

    return SDPAFluxProcessor


ENTERED: list[float] = []  # when this rank reached the call that fails (wall clock; the test compares ranks)


def _enter() -> None:
    ENTERED.append(time.time())


def _failure(case: str, rank: int, world: int) -> None:
    from xstage_dit.features import ParallelConfig, parallelize

    if case == "disagree":  # rank 0 asks sp=world, the others sp=1
        pipe = _flux()
        _enter()
        parallelize(pipe, ParallelConfig(sp=world if rank == 0 else 1))
    elif case == "seeds":  # each rank seeds its generator differently
        pipe = _flux()
        parallelize(pipe, ParallelConfig(sp=world))
        _enter()
        _output(pipe, FLUX_CALL, generator=_gen(rank))
    elif case == "bypass":
        pipe = _flux()
        cls = _bypassing_processor()
        for m in pipe.transformer.modules():
            if hasattr(m, "processor") and type(m.processor).__name__ == "FluxAttnProcessor":
                m.set_processor(cls())
        _enter()
        parallelize(pipe, ParallelConfig(sp=world))
        _output(pipe, FLUX_CALL)
    elif case == "short":  # 4 text tokens at sp=world > 4 ... or the image: 1 image token < sp
        pipe = _flux()
        parallelize(pipe, ParallelConfig(sp=world))
        _enter()
        _output(pipe, dict(FLUX_CALL, height=16, width=16))  # 16x16 -> 1 image token: a rank would hold none
    elif case in ("fail-one", "fail-one-even"):  # one rank fails inside the forward, the others are in a collective
        pipe = _flux()
        parallelize(pipe, ParallelConfig(sp=world))
        block = pipe.transformer.single_transformer_blocks[0]
        if rank == world - 1:
            def boom(module, args, kwargs):
                raise RuntimeError("injected failure in the single block")
            block.register_forward_pre_hook(boom, with_kwargs=True)
        _enter()
        # 48x48: 9 + 8 tokens, the others wait in the gather-KV all-gather; 64x64: 16 + 8, in the Ulysses all-to-all
        _output(pipe, FLUX_CALL if case == "fail-one" else dict(FLUX_CALL, height=64, width=64))
    else:
        raise ValueError(f"unknown failure case {case!r}")


def main() -> int:
    out_path, names = sys.argv[1], sys.argv[2:]
    from xstage_dit.comm.distributed import init_distributed

    info = init_distributed(backend="gloo", timeout_s=float(os.environ.get("XSTAGE_TEST_TIMEOUT", "60")))
    torch.set_num_threads(1)
    results = {}
    for name in names:
        t0 = time.perf_counter()
        if name in PIPELINES:
            results[name] = equivalence(name, info.world_size, reference=info.rank == 0)
        elif name in TRANSFORMERS:
            results[name] = transformer_equivalence(name, info.world_size, reference=info.rank == 0)
        elif name == "subclass":
            results[name] = subclass(info.world_size, reference=info.rank == 0)
        else:
            try:
                _failure(name, info.rank, info.world_size)
                results[name] = {"error": None}
            except Exception as exc:  # noqa: BLE001 - the test reads which error each rank ended with
                results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            results[name]["seconds"] = time.perf_counter() - t0
            results[name]["at"] = time.time()  # wall clock of this machine: the test compares the ranks
            results[name]["entered"] = ENTERED[-1] if ENTERED else None
            break  # after a failure the process group is not reusable: one failure case per launch
    with open(f"{out_path}.{info.rank}", "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    from xstage_dit.comm.distributed import close_distributed

    code = main()
    close_distributed()  # after a failure case too: the ranks meet on the store, not the (broken) group
    sys.exit(code)
