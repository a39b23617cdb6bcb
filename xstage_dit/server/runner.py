"""Runs one batch of compatible items through a diffusers pipeline, with no synchronization per step.

The batch is one pipeline call built by `xstage_dit.runtime.generation.pipeline_kwargs` (the rule
`xstage-dit generate` uses too): a list of prompts and one CPU `torch.Generator` per item, seeded with the
item's seed (diffusers draws each item's initial noise from its own generator). With ``one_at_a_time`` the
items run as consecutive calls of one image each: what the batcher asks for where a batched image would
differ from the one its seed alone gives (see `xstage_dit.server.batching`).

Per step the pipeline's `callback_on_step_end` (or, for a pipeline without one, a wrapper of its scheduler's
``step``) records a CUDA event (`StepClock`) and calls
``on_step(steps_done, steps_total, gpu_steps_done, step_times)``; nothing waits for the GPU: step times
come from events already complete (``query()``, never ``synchronize``), so progress trails the host by the
steps still queued on the GPU. ``on_step`` returns False to stop the batch there; every rank must return
the same answer at the same step (the worker's `StopVote` makes sure, without a blocking round trip).
"""

from __future__ import annotations

import collections
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from xstage_dit.features.instance_attr import set_on_instance
from xstage_dit.features.step_cache import cache_request
from xstage_dit.runtime.generation import GenerationRequest, output_pixels, pipeline_kwargs, run_pipeline
from xstage_dit.runtime.memory import refuse_out_of_memory
from xstage_dit.server.config import ServedModel
from xstage_dit.server.previews import PreviewPlan
from xstage_dit.server.video_stream import StreamedVideo, streams

log = logging.getLogger(__name__)


class BatchStopped(Exception):
    """Raised from the step callback when every job of the batch was cancelled or timed out."""

    def __init__(self, steps_done: int):
        super().__init__(f"batch stopped after step {steps_done}")
        self.steps_done = steps_done


class StepClock:
    """Per-step durations without a synchronization.

    mark() after each step: a CUDA event on the current stream (host time on a CPU, where work is
    synchronous). poll() returns the durations of the steps completed since the last poll, reading only
    events whose ``query()`` says they are done. The interval before the first mark (prompt encoding,
    latent set-up) is not a step and is never reported.
    """

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self._pending: collections.deque = collections.deque()
        self._last: Any = None
        self.completed = 0

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._pending.append(event)
        else:
            self._pending.append(time.perf_counter())

    def poll(self) -> list[float]:
        durations = []
        while self._pending:
            head = self._pending[0]
            if self.cuda and not head.query():
                break  # still queued on the GPU: read it at a later step, never wait for it
            self._pending.popleft()
            if self._last is not None:
                durations.append(self._last.elapsed_time(head) / 1000.0 if self.cuda else head - self._last)
            self._last = head
            self.completed += 1
        return durations


@dataclass
class RunResult:
    """pixels: uint8, (batch, H, W, C) images or (batch, frames, H, W, C) videos (`generation.output_pixels`).
    step_times: seconds of every step after the first of each pipeline call (GPU time on a GPU).
    cache: per pipeline call, its items and its step cache's counts (`features.step_cache`; None without one).
    video_stream: the MP4 encoded during the call (`video_stream.StreamedVideo`), when one was asked for and the
    pipeline streams: ``finish(pixels[0])`` it, or ``discard()`` the result."""

    pixels: np.ndarray
    step_times: list[float] = field(default_factory=list)
    video_stream: StreamedVideo | None = None
    cache: list[tuple[int, dict | None]] = field(default_factory=list)  # (items, step-cache counts) per call

    def discard(self) -> None:
        """Drop what the result still holds open (a video stream nobody will finish); idempotent."""
        stream, self.video_stream = self.video_stream, None
        if stream is not None:
            stream.abort()


class BatchRunner:
    """Calls `pipe` for a batch of `GenerationRequest` items with equal `batch_key`.

    adapters: the LoRA manager (`features.lora.LoraManager`; None: no LoRA): each call first makes its items'
    adapter set the active one, on every rank of `group` together (the worker's control group; None at world 1).
    A call that runs out of memory raises `runtime.memory.GenerationOutOfMemory` naming the request, after freeing
    what it took. recovery: a `server.recovery.Recovery`, which rebuilds the ranks' groups after a forward failed on
    one of them (None: world 1, or a pipeline handed in as it is)."""

    def __init__(self, pipe: Any, served: ServedModel, adapters: Any = None, group: Any = None, recovery: Any = None):
        self.pipe = pipe
        self.served = served
        self.adapters, self.group, self.recovery = adapters, group, recovery
        # per-step progress through the pipeline's callback_on_step_end, or (a pipeline without one: HunyuanVideo
        # 1.5's) after each call of its scheduler's step, which every denoising step makes once
        self.step_callback = "callback_on_step_end" in inspect.signature(pipe.__call__).parameters
        if not self.step_callback and not callable(getattr(getattr(pipe, "scheduler", None), "step", None)):
            raise TypeError(f"expected a pipeline with callback_on_step_end or a scheduler (per-step progress), got "
                            f"{type(pipe).__name__}")
        if hasattr(pipe, "set_progress_bar_config"):
            pipe.set_progress_bar_config(disable=True)
        self.device = getattr(pipe, "device", torch.device("cpu"))

    def run(self, items: list[GenerationRequest], on_step: Callable[[int, int, int, list], bool],
            one_at_a_time: bool = False, stream_video: bool = False, previews: PreviewPlan | None = None) -> RunResult:
        """Run the batch (one call, or one call per image); raises `BatchStopped` when `on_step` said False.
        stream_video: encode a video's MP4 while its VAE decodes (`video_stream`), where the pipeline allows it
        (the rank that answers asks for it). previews: the partial images its jobs asked for (rank 0 only)."""
        if not one_at_a_time:
            return self._call(items, on_step, stream_video, previews)
        singles = [one for item in items for one in item.per_image()]
        parts = [self._call([one], on_step, previews=previews, first_row=row) for row, one in enumerate(singles)]
        return RunResult(np.concatenate([p.pixels for p in parts]), [t for p in parts for t in p.step_times],
                         cache=[c for p in parts for c in p.cache])

    def warmup(self, item: GenerationRequest, on_step: Callable[[int, int, int, list], bool]) -> RunResult:
        """`run` of one warm-up item (or the batcher's probe batch); with LoRA hot-swap slots, once more with the
        LoRA layers on at scale 0, so the graphs of a LoRA request of this shape are compiled before any request
        (the same bytes: scale 0). Returns the first run's result."""
        result = self.run([item], on_step)
        if self.adapters is not None and self.adapters.graph_variants > 1:
            with self.adapters.warming():
                self.run([item], on_step)
        return result

    def _call(self, items: list[GenerationRequest], on_step, stream_video: bool = False,
              previews: PreviewPlan | None = None, first_row: int = 0) -> RunResult:
        if self.adapters is not None:
            self.adapters.activate(items[0].lora, group=self.group)
        elif items[0].lora:
            raise ValueError(f"expected no LoRA adapters (this pipeline serves none), got {items[0].lora}")
        kwargs = pipeline_kwargs(self.pipe, items, kind=self.served.kind, fixed=self.served.pipeline_kwargs,
                                 output_type="pt")
        total = items[0].steps
        clock = StepClock(self.device)
        step_times: list[float] = []

        def callback(pipe, step_index, timestep, callback_kwargs):
            clock.mark()
            finished = clock.poll()
            step_times.extend(finished)
            steps_total = int(getattr(pipe, "num_timesteps", None) or total)
            if not on_step(step_index + 1, steps_total, clock.completed, finished):
                raise BatchStopped(step_index + 1)
            if previews is not None and "latents" in callback_kwargs:
                previews.on_latents(pipe, step_index + 1, callback_kwargs["latents"], first_row, items[0].height,
                                    items[0].width)
            return {}

        undo_step = lambda: None  # noqa: E731
        if self.step_callback:
            kwargs["callback_on_step_end"] = callback
        else:
            undo_step = _after_scheduler_steps(self.pipe, lambda index: callback(self.pipe, index, None, {}))
        stream = None
        if stream_video and items[0].kind == "video" and len(items) == 1 and items[0].n == 1 and streams(self.pipe):
            stream = StreamedVideo(self.pipe, items[0].fps)
        cache_stats: list = []

        def call() -> np.ndarray:
            # the step cache's state is this call's own (reset before it), and its counts are read after it
            with cache_request(self.pipe, steps=total, threshold=items[0].cache_threshold) as cached:
                out = run_pipeline(self.pipe, **kwargs)
            cache_stats.append(cached.stats)
            if stream is not None:
                stream.detach()
            # uint8 on the host, rounded on the GPU (output_type "pt"): the one copy after the last step waits for it.
            return output_pixels(out, items[0].kind)

        try:
            pixels = refuse_out_of_memory(call, items, self.device)
            step_times.extend(clock.poll())  # the output is on the host: every step event has completed
            count = sum(item.n for item in items)
            if pixels.shape[0] != count:
                raise RuntimeError(f"expected pipeline output with batch {count}, got {tuple(pixels.shape)}")
        except BaseException:
            if stream is not None:
                stream.abort()  # stopped or failed: no MP4, no encoder left running
            if self.recovery is not None and self.recovery.maybe_recover():
                self.adapters = self.recovery.adapters
            raise
        finally:
            undo_step()
        return RunResult(pixels, step_times, stream, cache=[(count, cache_stats[-1])])


def _after_scheduler_steps(pipe: Any, on_step: Callable[[int], Any]) -> Callable[[], None]:
    """Call ``on_step(step_index)`` after each ``pipe.scheduler.step`` (an instance attribute over the class's
    method, for one pipeline call); returns the undo."""
    scheduler = pipe.scheduler
    step = scheduler.step
    calls = [0]

    def counted(*args, **kwargs):
        out = step(*args, **kwargs)
        calls[0] += 1
        on_step(calls[0] - 1)
        return out

    return set_on_instance(scheduler, "step", counted)
