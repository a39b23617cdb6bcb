"""Runs one batch of compatible items through a diffusers pipeline.

The batch is one pipeline call built by `xstage_dit.models.generation.pipeline_kwargs` (the rule
`xstage-dit generate` uses too): a list of prompts and one CPU `torch.Generator` per item, seeded with the
item's seed, so every image is the one its seed alone produces, on any device (diffusers draws each
item's initial noise from its own generator). Progress and cancellation go through the pipeline's
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

from xstage_dit.models.generation import GenerationRequest, pipeline_kwargs
from xstage_dit.server.config import ServedModel

log = logging.getLogger(__name__)


class BatchStopped(Exception):
    """Raised from the step callback when every job of the batch was cancelled or timed out."""

    def __init__(self, steps_done: int):
        super().__init__(f"batch stopped after step {steps_done}")
        self.steps_done = steps_done


class BatchRunner:
    """Calls `pipe` for a batch of `GenerationRequest` items with equal `batch_key`.

    run() returns float pixels in [0, 1]: (batch, height, width, 3) for images,
    (batch, num_frames, height, width, 3) for videos.
    """

    def __init__(self, pipe: Any, served: ServedModel):
        self.pipe = pipe
        self.served = served
        if "callback_on_step_end" not in inspect.signature(pipe.__call__).parameters:
            raise TypeError(f"expected a pipeline with callback_on_step_end (per-step progress), got "
                            f"{type(pipe).__name__}")
        if hasattr(pipe, "set_progress_bar_config"):
            pipe.set_progress_bar_config(disable=True)

    def run(self, items: list[GenerationRequest], on_step: Callable[[int, int], bool]) -> np.ndarray:
        """Run the batch; raises `BatchStopped` when `on_step` returned False."""
        kwargs = pipeline_kwargs(self.pipe, items, kind=self.served.kind, fixed=self.served.pipeline_kwargs)
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
        count = sum(item.n for item in items)
        if pixels.ndim != want or pixels.shape[0] != count:
            raise RuntimeError(f"expected pipeline output of {want} dims with batch {count}, got "
                               f"{tuple(pixels.shape)}")
        return pixels
