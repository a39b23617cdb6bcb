"""Partial images (`xstage_dit.server.previews`): the steps a preview follows, the rows of a batch it decodes, and,
for every image family, that the family's decode tail (``FamilyRecord.latent_decode``) applied to the last step's
latents gives the pipeline's own output: a preview is the image the pipeline would return if it stopped there."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from xstage_dit.families import load_pipeline, model_spec
from xstage_dit.families.registry import records
from xstage_dit.runtime.generation import (GenerationRequest, fixed_kwargs, output_pixels, pipeline_kwargs,
                                           run_pipeline)
from xstage_dit.server.previews import PreviewPlan, decode_latents, preview_steps
from tests.helpers.server import assert_same_image, one_torch_thread

IMAGE_FAMILIES = sorted(r.name for r in records().values() if r.kind == "image" and r.spec("tiny") is not None)


@pytest.mark.parametrize("steps, count, want", [
    (4, 3, [1, 2, 3]), (8, 3, [2, 4, 6]), (10, 2, [4, 7]), (28, 1, [14]), (4, 0, []),
    (2, 3, [1]), (1, 2, []),  # fewer steps than previews: each before the last step, none after it
])
def test_previews_are_evenly_spaced_and_before_the_last_step(steps, count, want):
    assert preview_steps(steps, count) == want


def test_every_image_family_has_a_decode_tail():
    missing = [r.name for r in records().values() if r.kind == "image" and r.pipelines and r.latent_decode is None]
    assert not missing, f"image families without FamilyRecord.latent_decode: {missing}"


def _item(seed: int) -> GenerationRequest:
    return GenerationRequest(kind="image", prompt="x", width=32, height=32, steps=4, guidance=1.0, seed=seed)


def test_the_plan_maps_batch_rows_to_their_jobs_and_images():
    a = SimpleNamespace(partial_images=2, done=False)
    b = SimpleNamespace(partial_images=0, done=False)
    c = SimpleNamespace(partial_images=1, done=False)
    batch = SimpleNamespace(items=[_item(0), _item(1), _item(2), _item(3)], owners=[a, a, b, c])
    plan = PreviewPlan.for_batch(batch)
    # a: 2 previews of 4 steps after steps 2 and 3, both its images (rows 0, 1); c: 1 after step 2 (row 3)
    assert {step: [(row, job is a, index, image) for row, job, index, image in rows]
            for step, rows in plan.rows.items()} == {
        2: [(0, True, 0, 0), (1, True, 0, 1), (3, False, 0, 0)], 3: [(0, True, 1, 0), (1, True, 1, 1)]}
    assert PreviewPlan.for_batch(SimpleNamespace(items=[_item(0)], owners=[b])) is None


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_the_decode_of_the_last_latents_is_the_pipeline_output(family):
    spec = records()[family].spec("tiny")
    name = spec.name
    with one_torch_thread():
        pipe = load_pipeline(name, dtype=torch.float32, device="cpu", seed=0)
        size = max(spec.patch_multiple * 2, 64)
        seen = {}

        def keep(p, index, timestep, kwargs):
            seen[index] = kwargs["latents"].clone()
            return {}

        items = [GenerationRequest(kind="image", prompt=prompt, width=size, height=size, steps=2,
                                   guidance=spec.guidance, seed=seed) for prompt, seed in (("a red fox", 1),
                                                                                           ("a blue car", 2))]
        kwargs = pipeline_kwargs(pipe, items, kind="image", fixed=fixed_kwargs(model_spec(name)), output_type="pt")
        out = run_pipeline(pipe, **kwargs, callback_on_step_end=keep)
        want = output_pixels(out, "image")
        got = decode_latents(pipe, seen[1], size, size)
        assert got.shape == want.shape and got.dtype == np.uint8, (got.shape, want.shape)
        assert np.array_equal(got, want), f"{family}: max difference {np.abs(got.astype(int) - want).max()}"
        # a row alone decodes to its own image (what a preview of one job of a batch does), up to the one uint8
        # level a batched convolution may round differently
        assert_same_image(decode_latents(pipe, seen[1][1:], size, size)[0], want[1], f"{family} row 1 alone")
        # and an earlier step's latents are another picture (the comparison above can fail)
        assert not np.array_equal(decode_latents(pipe, seen[0], size, size), want)
