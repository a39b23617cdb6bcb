"""`xstage-dit generate --image / --mask / --size` through the real CLI: an edit, an inpainting and an image-to-video
give the diffusers pipeline's own output for the same image, prompt and seed (at sp=2 too); every bad input is a
one-line error naming the option, before anything is built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from xstage_dit.cli import main
from tests.helpers.family_harness import seeded_image
from tests.helpers.server import assert_same_image, one_torch_thread

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    paths = {"image": tmp_path / "in.png", "wide": tmp_path / "wide.png", "mask": tmp_path / "mask.png",
             "small_mask": tmp_path / "small_mask.png", "text": tmp_path / "notes.png", "cut": tmp_path / "cut.png"}
    seeded_image(1, 96, 64).save(paths["image"])
    seeded_image(2, 80, 48).save(paths["wide"])
    seeded_image(3, 96, 64, "L").save(paths["mask"])
    seeded_image(3, 64, 64, "L").save(paths["small_mask"])
    paths["text"].write_text("not an image")
    paths["cut"].write_bytes(paths["image"].read_bytes()[:300])  # a PNG cut short
    return paths


def _direct(model: str, size: tuple[int, int], seed: int, image: Path | list[Path], mask: Path | None = None,
            steps: int = 2, frames: int | None = None) -> np.ndarray:
    """The unpatched diffusers pipeline with the product's arguments: uint8 pixels ([frames,] H, W, 3)."""
    from xstage_dit.families import load_pipeline, model_spec
    from xstage_dit.runtime.generation import fixed_kwargs, output_pixels, pipeline_kwargs, request_for

    spec = model_spec(model)
    pipe = load_pipeline(model, seed=0)
    paths = image if isinstance(image, list) else [image]
    request = request_for(spec, prompt="make it snow", seed=seed, steps=steps, width=size[0], height=size[1],
                          frames=frames, images=[Image.open(p) for p in paths],
                          mask=None if mask is None else Image.open(mask))
    return output_pixels(pipe(**pipeline_kwargs(pipe, [request], kind=spec.kind, fixed=fixed_kwargs(spec))),
                         spec.kind)[0]


@pytest.mark.parametrize("argv, needle", [
    (["--model", "tiny-flux", "--image", "{image}"],
     "--image: expected no input image for tiny-flux (its pipeline takes none), got 1"),
    (["--model", "tiny-flux-img2img"], "--image: expected 1 input image(s) for tiny-flux-img2img, got 0"),
    (["--model", "tiny-flux-kontext", "--image", "{image}", "--image", "{wide}"],
     "--image: expected 0 to 1 input image(s) for tiny-flux-kontext, got 2"),
    (["--model", "tiny-flux-fill", "--image", "{image}", "--mask", "{small_mask}"],
     "--mask: expected the image's size 96x64, got 64x64"),
    (["--model", "tiny-flux-kontext", "--image", "{image}", "--mask", "{mask}"],
     "--mask: expected no mask for tiny-flux-kontext"),
    (["--model", "tiny-wan", "--image", "{image}"], "--image: expected no input image for tiny-wan"),
    (["--model", "tiny-wan-flf2v", "--image", "{image}"],
     "--image: expected 2 input image(s) for tiny-wan-flf2v, got 1"),
    (["--model", "tiny-wan-i2v", "--image", "{image}", "--image", "{wide}"],
     "--image: expected 1 input image(s) for tiny-wan-i2v, got 2"),
    (["--model", "tiny-hunyuanvideo15-i2v", "--image", "{image}", "--size", "64x64"],
     "--size: expected no width x height or 64x48 for tiny-hunyuanvideo15-i2v (its pipeline sizes the video from"),
    (["--model", "tiny-flux-kontext", "--image", "{text}"], "--image: expected a PNG, JPEG or WebP image, got"),
    (["--model", "tiny-flux-kontext", "--image", "{cut}"], "--image: expected a PNG, JPEG or WebP image, got"),
    (["--model", "tiny-flux-kontext", "--image", "missing.png"], "--image: expected an image file, got 'missing.png'"),
    (["--size", "96by64"], "--size: expected 'WIDTHxHEIGHT' such as '96x64', got '96by64'"),
    (["--size", "96x64", "--height", "64"], "--size: expected either --size or --width/--height, got both"),
    (["--size", "72x64"], "--size: expected width to be a positive multiple of 16 for tiny-flux, got 72"),
])
def test_bad_inputs_give_one_line_errors_naming_the_option(argv, needle, files, capsys):
    argv = [a.format(**{k: str(v) for k, v in files.items()}) for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(["generate", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("xstage-dit: error: "), err
    assert needle in err, err


def test_size_sets_the_output_size_of_a_text_model(tmp_path):
    out = tmp_path / "fox.png"
    assert main(["generate", "--model", "tiny-flux", "--size", "96x64", "--steps", "1", "--output", str(out),
                 "--no-progress"]) == 0
    assert Image.open(out).size == (96, 64)


def test_an_edit_is_the_pipelines_output_for_the_image(files, tmp_path):
    """FLUX.1 Kontext: no --size = the image's size; the PNG is what the pipeline gives for that image and seed."""
    out = tmp_path / "edit.png"
    with one_torch_thread():
        assert main(["generate", "--model", "tiny-flux-kontext", "--image", str(files["image"]), "--prompt",
                     "make it snow", "--seed", "5", "--steps", "2", "--output", str(out), "--no-progress"]) == 0
        want = _direct("tiny-flux-kontext", (96, 64), 5, files["image"])
    got = np.asarray(Image.open(out).convert("RGB"))
    assert_same_image(got, want, "cli vs diffusers")
    assert got.std() > 1.0
    other = _direct("tiny-flux-kontext", (96, 64), 5, files["wide"])  # another image changes the output
    assert np.abs(other.astype(int) - want.astype(int)).max() > 1


def test_inpainting_with_a_mask(files, tmp_path):
    out = tmp_path / "fill.png"
    with one_torch_thread():
        assert main(["generate", "--model", "tiny-flux-fill", "--image", str(files["image"]), "--mask",
                     str(files["mask"]), "--prompt", "make it snow", "--seed", "3", "--steps", "2", "--output",
                     str(out), "--no-progress"]) == 0
        want = _direct("tiny-flux-fill", (96, 64), 3, files["image"], files["mask"])
    assert_same_image(np.asarray(Image.open(out).convert("RGB")), want, "cli vs diffusers")


# Wan FLF2V: --image twice, the first and the last frame
@pytest.mark.parametrize("model, images, fps, size, frames", [
    ("tiny-wan-i2v", ["image"], 16, (64, 48), 5),
    ("tiny-wan-flf2v", ["image", "wide"], 16, (64, 48), 5),
    ("tiny-hunyuanvideo-i2v", ["image"], 24, (64, 48), 5),
    ("tiny-hunyuanvideo15-i2v", ["image"], 24, (64, 48), 5),  # it sizes the video: a 3:2 image makes 64x48
    ("tiny-ltx-condition", ["image"], 24, (96, 64), 9),
    ("tiny-ltx2-i2v", ["image"], 24, (64, 32), 5),
    ("tiny-skyreels-v2-i2v", ["image"], 24, (64, 48), 5),
])
def test_image_to_video_writes_the_pipelines_frames(model, images, fps, size, frames, files, tmp_path):
    from xstage_dit.runtime.generation import read_mp4
    from xstage_dit.runtime.mp4 import encode_mp4

    out = tmp_path / "fox.mp4"
    given = [a for key in images for a in ("--image", str(files[key]))]
    with one_torch_thread():
        assert main(["generate", "--model", model, *given, "--prompt", "make it snow", "--seed", "2", "--steps", "2",
                     "--frames", str(frames), "--size", f"{size[0]}x{size[1]}", "--output", str(out),
                     "--no-progress"]) == 0
        want = _direct(model, size, 2, [files[key] for key in images], frames=frames)
    assert want.shape == (frames, size[1], size[0], 3)
    assert out.read_bytes() == encode_mp4(want, fps)  # the same frames, the same encoder: the same bytes
    assert read_mp4(out.read_bytes()).shape == (frames, size[1], size[0], 3)


@pytest.mark.slow  # two ranks started by the command, ~30-40 s on the 2-core CI machine
def test_an_edit_at_sp_2_matches_one_process(files, tmp_path):
    out = tmp_path / "sp2.png"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "xstage_dit", "generate", "--model", "tiny-flux-kontext", "--image",
                           str(files["image"]), "--prompt", "make it snow", "--seed", "5", "--steps", "2", "--sp", "2",
                           "--output", str(out), "--no-progress"], env=env, capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stderr[-2000:]
    with one_torch_thread():
        want = _direct("tiny-flux-kontext", (96, 64), 5, files["image"])
    assert_same_image(np.asarray(Image.open(out).convert("RGB")), want, "sp=2 cli vs diffusers")
