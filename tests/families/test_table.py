"""The README's model table from family records (`xstage_dit.families.table`), on two hand-made records."""

from __future__ import annotations

import contextlib

import pytest

from xstage_dit.families.record import ExpertFacts, FamilyRecord, ImageInputFacts, SequenceParallelFacts
from xstage_dit.families.spec import ModelSpec
from xstage_dit.families.table import BEGIN, END, model_table_markdown, rewrite_block, row


def _build(transformer):
    raise AssertionError("the table never builds a plan")


def _image_record() -> FamilyRecord:
    spec = dict(family="pix", kind="image", pipeline_class="PixPipeline", patch_multiple=16, steps=4, guidance=3.5)
    return FamilyRecord(
        name="pix", title="Pix", kind="image",
        pipelines={"PixPipeline": "t2i", "PixEditPipeline": "edit"},
        transformers=("PixTransformer2DModel",),
        sp=SequenceParallelFacts(plan_source="diffusers", build=_build, cfg="paired"),
        specs=(ModelSpec(name="tiny-pix", size="tiny", height=64, width=64, **spec),
               ModelSpec(name="full-pix", size="full", height=1024, width=1024, **spec)),
        build=_unused, image_inputs={"PixEditPipeline": ImageInputFacts()},
    )


def _unused(*args):
    raise AssertionError("the table never builds experts")


def _video_moe_record() -> FamilyRecord:
    return FamilyRecord(
        name="mov", title="Mov", kind="video",
        pipelines={"MovPipeline": "t2v", "MovImageToVideoPipeline": "i2v"},
        transformers=("MovTransformer3DModel", "MovLiteTransformer3DModel"),
        sp=SequenceParallelFacts(plan_source="xstage", build=_build, cfg=None),
        experts=ExpertFacts(layer_class="MovMoELayer", ep_layer="somewhere:MovEPLayer", count_key="num_experts",
                            meta_experts=contextlib.nullcontext, num_experts=len, dims=lambda layer: (8, 16),
                            random_experts=_unused, read_experts=_unused, materialize=_unused),
        image_inputs={"MovImageToVideoPipeline": ImageInputFacts(size_from_image=False)},
    )


def test_one_row_per_record_with_every_column():
    table = model_table_markdown([_video_moe_record(), _image_record()])
    header, rule, image, video = table.split("\n")
    assert header.count("|") == rule.count("|") == 6
    # the edit and image-to-video pipelines are served too (issue 39)
    assert image == ("| Pix (`PixTransformer2DModel`) | sp, cfg (paired) | `PixPipeline`, `PixEditPipeline` "
                     "| `tiny-pix` / `full-pix` | text->image, image edit |")
    assert video == ("| Mov (`MovTransformer3DModel`, `MovLiteTransformer3DModel`) | sp, ep "
                     "| `MovPipeline`, `MovImageToVideoPipeline` | - / - | text->video, image->video |")


def test_a_family_without_a_text_pipeline_is_python_only():
    record = FamilyRecord(name="mod", title="Mod", kind="video", pipelines={}, transformers=("ModTransformer",),
                          sp=SequenceParallelFacts(plan_source="diffusers", build=_build))
    assert row(record) == "| Mod (`ModTransformer`) | sp, cfg (paired) | - | - / - | - |"


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="expected FamilyRecord values, got dict"):
        model_table_markdown([{"name": "pix"}])


def test_the_block_between_the_markers_is_rewritten_and_the_rest_kept(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# top\n\n{BEGIN}\nold\n{END}\n\ntail\n", encoding="utf-8")
    table = model_table_markdown([_image_record()])
    assert rewrite_block(readme, table) is True
    assert readme.read_text(encoding="utf-8") == f"# top\n\n{BEGIN}\n{table}\n{END}\n\ntail\n"
    assert rewrite_block(readme, table) is False  # up to date
    (tmp_path / "plain.md").write_text("no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="expected the markers"):
        rewrite_block(tmp_path / "plain.md", table)
