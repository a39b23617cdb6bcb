"""Runs one batch of compatible items through a diffusers pipeline.

The batch is one pipeline call with a list of prompts and one `torch.Generator` per item, seeded with
the item's seed, so every image is the one its seed alone produces (diffusers draws each item's
initial noise from its own generator). Progress and cancellation go through the pipeline's
`callback_on_step_end`: `on_step(steps_done, steps_total)` runs after every step on every rank and
returns False to stop the batch there (every rank must return the same answer: the worker makes
rank 0 decide and broadcasts the decision).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import numpy as np
import torch

from xstage_dit.server.config import ServedModel
from xstage_dit.server.jobs import GenerationParams

log = logging.getLogger(__name__)


class BatchStopped(Exception):
    """Raised from the step callback when every job of the batch was cancelled or timed out."""

    def __init__(self, steps_done: int):
        super().__init__(f"batch stopped after step {steps_done}")
        self.steps_done = steps_done


class BatchRunner:
    """Calls `pipe` for a batch of `GenerationParams` with equal `batch_key`.

    run() returns float pixels in [0, 1]: (batch, height, width, 3) for images,
    (batch, num_frames, height, width, 3) for videos.
    """

    def __init__(self, pipe: Any, served: ServedModel):
        self.pipe = pipe
        self.served = served
        self._accepted = set(inspect.signature(pipe.__call__).parameters)
        if "callback_on_step_end" not in self._accepted:
            raise TypeError(f"expected a pipeline with callback_on_step_end (per-step progress), got "
                            f"{type(pipe).__name__}")
        if hasattr(pipe, "set_progress_bar_config"):
            pipe.set_progress_bar_config(disable=True)

    def _kwargs(self, items: list[GenerationParams]) -> dict[str, Any]:
        first = items[0]
        keys = {item.batch_key for item in items}
        if len(keys) != 1:
            raise ValueError(f"expected items with one batch_key, got {len(keys)} different ones")
        kwargs: dict[str, Any] = dict(self.served.pipeline_kwargs)
        kwargs.update(
            prompt=[item.prompt for item in items],
            height=first.height,
            width=first.width,
            num_inference_steps=first.steps,
            guidance_scale=first.guidance,
            # CPU generators: the same noise on every rank and on any device.
            generator=[torch.Generator("cpu").manual_seed(item.seed) for item in items],
            output_type="np",
        )
        if first.negative_prompt is not None:
            kwargs["negative_prompt"] = [item.negative_prompt for item in items]
        if first.true_cfg_scale is not None:
            kwargs["true_cfg_scale"] = first.true_cfg_scale
        if first.kind == "video":
            kwargs["num_frames"] = first.num_frames
        dropped = sorted(k for k in kwargs if k not in self._accepted)
        for k in dropped:
            if k in ("negative_prompt", "true_cfg_scale", "num_frames"):
                raise ValueError(f"expected a pipeline accepting {k}, got {type(self.pipe).__name__} without it")
            kwargs.pop(k)
        return kwargs

    def run(self, items: list[GenerationParams], on_step: Callable[[int, int], bool]) -> np.ndarray:
        """Run the batch; raises `BatchStopped` when `on_step` returned False."""
        kwargs = self._kwargs(items)
        total = items[0].steps

        def callback(pipe, step_index, timestep, callback_kwargs):
            steps_total = int(getattr(pipe, "num_timesteps", None) or total)
            if not on_step(step_index + 1, steps_total):
                raise BatchStopped(step_index + 1)
            return {}

        kwargs["callback_on_step_end"] = callback
        with torch.inference_mode():
            out = self.pipe(**kwargs)
        pixels = out.frames if items[0].kind == "video" else out.images
        if isinstance(pixels, torch.Tensor):
            pixels = pixels.float().cpu().numpy()
        pixels = np.asarray(pixels)
        if pixels.ndim == 5 and pixels.shape[2] in (1, 3) and pixels.shape[-1] not in (1, 3):
            pixels = pixels.transpose(0, 1, 3, 4, 2)  # (B, F, C, H, W) -> (B, F, H, W, C)
        want = 5 if items[0].kind == "video" else 4
        if pixels.ndim != want or pixels.shape[0] != len(items):
            raise RuntimeError(f"expected pipeline output of {want} dims with batch {len(items)}, got "
                               f"{tuple(pixels.shape)}")
        return pixels
