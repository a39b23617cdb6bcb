"""The tiny pipelines and calls the step-cache tests share (world 1 and the rank programs): FLUX (guidance-
distilled, one call a step), Wan (CFG: a cond and an uncond call a step, video) and Qwen-Image (true CFG with a
negative prompt), each at a size that splits over 2 and 4 ranks. Qwen-Image's tiny transformer has one block, and
First Block Cache needs two (the first decides, the others are skipped): its case builds it with two."""

from __future__ import annotations

import numpy as np
import torch

# model -> the call's keywords (besides prompt, steps and generator); tokens: FLUX 64x64 -> 16, Wan 32x32x5 ->
# 2 latent frames x 2 x 2 = 8, Qwen-Image 48x48 -> 9 (3, 2, 2, 2 over 4 ranks)
CALLS = {
    "tiny-flux": dict(height=64, width=64, guidance_scale=3.5),
    "tiny-wan": dict(height=32, width=32, num_frames=5, guidance_scale=5.0, negative_prompt="blurry"),
    "tiny-qwenimage": dict(height=48, width=48, true_cfg_scale=4.0, negative_prompt="blurry"),
}
CFG_MODELS = ("tiny-wan", "tiny-qwenimage")  # CFG parallel applies (FLUX.1's tiny model is guidance-distilled)


# The tiny transformers as sp = 4 can split them (every rank needs a head: 4 heads of 8 instead of FLUX's and Wan's
# 2 of 16) and First Block Cache can use them (two blocks, where Qwen-Image's tiny one has one).
TRANSFORMERS = {
    "tiny-flux": ("FluxTransformer2DModel", "flux", dict(num_attention_heads=4, attention_head_dim=8,
                                                         axes_dims_rope=(2, 2, 4))),
    "tiny-wan": ("WanTransformer3DModel", "wan", dict(num_attention_heads=4, attention_head_dim=8)),
    "tiny-qwenimage": ("QwenImageTransformer2DModel", "qwenimage", dict(num_layers=2)),
}


def pipeline(model: str, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The tiny pipeline of `model` (float32 on the CPU by default), its transformer as `TRANSFORMERS` says."""
    import importlib

    import diffusers

    from xstage_dit.families import load_pipeline
    from xstage_dit.families.build import build_module

    pipe = load_pipeline(model, dtype=dtype, device=device, seed=seed)
    pipe.set_progress_bar_config(disable=True)
    cls, family, dims = TRANSFORMERS[model]
    tiny = importlib.import_module(f"xstage_dit.families.{family}").TRANSFORMER["tiny"]
    pipe.register_modules(transformer=build_module(lambda: getattr(diffusers, cls)(**{**tiny, **dims}), seed=seed,
                                                   device=device, dtype=dtype))
    return pipe


def image(pipe, model: str, steps: int = 4, seed: int = 7, prompt: str = "a red fox in the snow", **extra) -> np.ndarray:
    """The call's output (images, or video frames) as float32."""
    from xstage_dit.families import model_spec
    from xstage_dit.runtime.generation import fixed_kwargs

    out = pipe(prompt=prompt, num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(seed),
               output_type="np", **{**fixed_kwargs(model_spec(model)), **CALLS[model], **extra})
    return np.asarray(out.frames if model == "tiny-wan" else out.images, dtype=np.float32)
