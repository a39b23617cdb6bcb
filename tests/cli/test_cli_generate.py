"""`xstage-dit generate`: documented options, one-line errors naming the bad value, a real PNG."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from PIL import Image

from xstage_dit.cli import build_parser, main


def _generate_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["generate"]


def test_help_documents_every_option(capsys):
    gen = _generate_parser()
    for action in gen._actions:
        assert action.help and action.help != argparse.SUPPRESS, f"undocumented option {action.option_strings}"
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--model", "--prompt", "--height", "--width", "--frames", "--steps", "--seed", "--weights-seed", "--guidance",
                "--output", "--device", "--dtype", "--negative-prompt", "--no-progress"):
        assert opt in out
    assert "tiny-flux" in out and "full-flux" in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--steps", "-3"], "-3"),
        (["--steps", "0"], "got 0"),
        (["--height", "100"], "100"),
        (["--width", "72"], "72"),
        (["--model", "no-such-model"], "no-such-model"),
        (["--model", "./missing/folder"], "missing/folder"),
        (["--guidance", "-1"], "-1"),
        (["--frames", "9"], "9"),
        (["--output", "x.gif"], "x.gif"),
        (["--output", "x.mp4"], "x.mp4"),  # an image model cannot write a video
        (["--device", "tpu"], "tpu"),
        (["--model", "tiny-wan", "--frames", "8"], "got 8"),  # Wan: 1 + a multiple of 4
        (["--prompt", "   "], "prompt"),
        (["--seed", "-1"], "--seed"),
        (["--cfg", "3"], "--cfg"),
        (["--sp", "2", "--ep", "3"], "--ep"),
    ],
)
def test_bad_values_give_one_line_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("xstage-dit: error: ") and needle in err


def test_argparse_rejects_non_integers(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--steps", "four"])
    assert exc.value.code == 2
    assert "four" in capsys.readouterr().err


def test_generate_writes_png_and_reports_time(tmp_path, capsys):
    out = tmp_path / "sub" / "fox.png"
    rc = main(["generate", "--model", "tiny-flux", "--prompt", "ein Fuchs im Schnee 🦊", "--steps", "2",
               "--height", "48", "--width", "80", "--seed", "5", "--output", str(out), "--no-progress"])
    assert rc == 0
    img = Image.open(out)
    assert img.size == (80, 48) and img.mode == "RGB"
    assert len(np.unique(np.asarray(img).reshape(-1, 3), axis=0)) > 10  # a real image, not a constant fill
    stdout = capsys.readouterr().out
    assert str(out.resolve()) in stdout and "time:" in stdout


def test_generate_video_as_mp4_and_as_frame_grid(tmp_path, capsys):
    import imageio.v3 as iio

    common = ["generate", "--model", "tiny-wan", "--frames", "5", "--height", "32", "--width", "48", "--steps", "1",
              "--no-progress"]
    assert main([*common, "--output", str(tmp_path / "v.mp4")]) == 0
    assert iio.imread(tmp_path / "v.mp4").shape[:3] == (5, 32, 48)
    assert main([*common, "--output", str(tmp_path / "v.png")]) == 0
    assert Image.open(tmp_path / "v.png").size == (3 * 48, 2 * 32)  # 5 frames in a 3 x 2 grid
    assert "5 frames" in capsys.readouterr().out


def test_generate_from_a_local_diffusers_folder(tmp_path, capsys):
    from xstage_dit.families import load_pipeline

    load_pipeline("tiny-flux", seed=2).save_pretrained(tmp_path / "my-flux")
    out = tmp_path / "local.png"
    rc = main(["generate", "--model", str(tmp_path / "my-flux"), "--steps", "1", "--height", "32", "--width", "32",
               "--output", str(out), "--no-progress"])
    assert rc == 0 and Image.open(out).size == (32, 32)
    assert "my-flux" in capsys.readouterr().out
