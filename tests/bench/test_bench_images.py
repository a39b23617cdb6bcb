"""`xstage-dit bench` on the image-conditioned models: every contender edits (or animates) the same input image (a
synthetic one of the run's size by default, or --image files), the served row through /v1/images/edits or
input_reference of /v1/videos, and each output is the bare diffusers call's."""

from __future__ import annotations

import json

import pytest

from xstage_dit import cli


def _rows(tmp_path, model: str, *extra: str) -> tuple[dict, dict]:
    rc = cli.main(["bench", "--model", model, "--num-prompts", "1", "--steps", "2", "--out-dir", str(tmp_path),
                   "--contenders", "diffusers,xstage-calibrated,xstage-served", *extra])
    assert rc == 0
    record = json.loads(next(tmp_path.glob(f"e2e-{model}-1xcpu.json")).read_text(encoding="utf-8"))
    return {r["name"]: r for r in record["rows"]}, record["summary"]["settings"]


def test_kontext_edits_the_same_image_bare_and_served(tmp_path):
    rows, settings = _rows(tmp_path, "tiny-flux-kontext", "--height", "64", "--width", "96")
    assert settings["input_images"] == ["96x64"] and settings["input_images_from"] == "synthetic"
    for name in ("xstage-calibrated", "xstage-served"):
        assert rows[name]["status"] == "ok", rows[name]
        # the same edit as plain diffusers (the served one through its PNG: one rounding)
        assert rows[name]["output_max_abs_diff_vs_diffusers"] < (1e-3 if name != "xstage-served" else 1 / 255 + 1e-3)
    assert "--height 64" in settings["command"]


def test_image_to_video_and_image_files(tmp_path):
    from tests.helpers.family_harness import seeded_image

    path = tmp_path / "first.png"
    seeded_image(3, 80, 60).save(path)
    rows, settings = _rows(tmp_path, "tiny-wan-i2v", "--height", "48", "--width", "64", "--frames", "5",
                           "--image", str(path))
    assert settings["input_images"] == ["80x60"] and settings["input_images_from"] == "files"
    assert f"--image {path}" in settings["command"]  # a repeatable option, repeated in the command line
    assert rows["xstage-served"]["status"] == "ok", rows["xstage-served"]
    assert rows["xstage-served"]["output_max_abs_diff_vs_diffusers"] < 0.5  # H.264 is lossy
    assert rows["xstage-calibrated"]["output_max_abs_diff_vs_diffusers"] < 1e-3


@pytest.mark.parametrize("argv, needle", [
    (["--model", "tiny-flux", "--image", "{image}"], "expected no input image for tiny-flux"),
    (["--model", "tiny-flux-kontext", "--image", "missing.png"], "expected --image to be an image file"),
])
def test_bad_inputs_are_named(argv, needle, tmp_path, capsys):
    from tests.helpers.family_harness import seeded_image

    seeded_image(1, 64, 64).save(tmp_path / "in.png")
    argv = [a.format(image=tmp_path / "in.png") for a in argv]
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--num-prompts", "1", "--steps", "1", "--out-dir", str(tmp_path), *argv])
    assert exc.value.code == 2 and needle in capsys.readouterr().err
