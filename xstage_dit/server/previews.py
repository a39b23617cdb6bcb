"""Partial images of a streamed image request (OpenAI's ``partial_images``): the latents of a step, decoded
through the pipeline's own VAE while the batch runs.

A job that asks for ``k`` previews (1..3) of an ``S``-step generation gets them after steps
``ceil(i * S / (k + 1))`` for ``i = 1..k`` (`preview_steps`): evenly spaced, each strictly before the last step
(whose decode is the final image), so a generation of ``S <= k`` steps sends ``S - 1`` previews, as OpenAI allows
("the final image may be sent before the full number of partial images"). At such a step the runner hands the
step's latents (``callback_kwargs["latents"]``, the pipeline's own layout) to `PreviewPlan.on_latents`, which
decodes the rows of the jobs that want one with the family's decode tail (``FamilyRecord.latent_decode``,
`families.latent_decode`) and the pipeline's ``image_processor``, rounds them by the one pixel rule, encodes them
in the job's format and publishes them to the job's stream (`Job.publish_event`) before the next step starts, so
a preview always comes before the final image. Only rank 0 decodes: the latents are whole on every rank (the
sequence split lives inside the transformer), the VAE is not parallelized, and the other ranks meet rank 0 again
at the next step's collectives. A preview costs its VAE decode and encode on the request's critical path, only for
requests that ask for one.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from xstage_dit.families.registry import record_for_pipeline
from xstage_dit.runtime.generation import to_uint8_tensor
from xstage_dit.server.media import image_bytes


def preview_steps(steps: int, count: int) -> list[int]:
    """The steps (1-based, after which) a `count`-preview job of `steps` steps decodes: ceil(i*S/(k+1)), i=1..k,
    those before the last step."""
    return sorted({math.ceil(i * steps / (count + 1)) for i in range(1, count + 1)} & set(range(1, steps)))


def decode_latents(pipe: Any, latents: torch.Tensor, height: int, width: int) -> np.ndarray:
    """latents: a step's latents of `pipe` (its layout, batch first) -> (batch, height, width, C) uint8, the
    pixels the pipeline would return for them (its family's decode tail, its image processor, `to_uint8`)."""
    record = record_for_pipeline(pipe)
    if record is None or record.latent_decode is None:
        raise ValueError(f"expected a pipeline whose family record has a latent_decode, got {type(pipe).__name__}")
    with torch.inference_mode():
        image = record.latent_decode(pipe, latents, height, width)
        image = pipe.image_processor.postprocess(image, output_type="pt")
        return to_uint8_tensor(image).permute(0, 2, 3, 1).contiguous().cpu().numpy()


class PreviewPlan:
    """Which rows of a batch decode a preview after which step. rows: ``step -> [(row, job, index, image)]``: row
    the image's place in the batch (`Batch.items`), index its ``partial_image_index``, image its place in its job."""

    def __init__(self, rows: dict[int, list[tuple[int, Any, int, int]]]):
        self.rows = rows

    @classmethod
    def for_batch(cls, batch: Any) -> "PreviewPlan | None":
        """The plan of `batch` (a `job_queue.Batch`), or None when no job of it wants a preview."""
        rows: dict[int, list[tuple[int, Any, int, int]]] = {}
        seen: dict[int, int] = {}  # id(job) -> images of it so far
        for row, (item, job) in enumerate(zip(batch.items, batch.owners)):
            image = seen[id(job)] = seen.get(id(job), -1) + 1
            for index, step in enumerate(preview_steps(item.steps, job.partial_images)):
                rows.setdefault(step, []).append((row, job, index, image))
        return cls(rows) if rows else None

    def on_latents(self, pipe: Any, step: int, latents: torch.Tensor, first_row: int, height: int,
                   width: int) -> None:
        """After `step` of a pipeline call whose latents hold batch rows ``first_row ..``: decode, encode and
        publish the previews due now (jobs already ended are skipped)."""
        wanted = [entry for entry in self.rows.get(step, ())
                  if first_row <= entry[0] < first_row + latents.shape[0] and not entry[1].done]
        if not wanted:
            return
        local = torch.tensor([row - first_row for row, *_ in wanted], device=latents.device)
        pixels = decode_latents(pipe, latents.index_select(0, local), height, width)
        for (row, job, index, image), picture in zip(wanted, pixels):
            job.publish_event({"job_id": job.id, "status": job.status, "partial_image": {
                "partial_image_index": index, "image_index": image, "data": image_bytes(picture, job.encoding)}})
