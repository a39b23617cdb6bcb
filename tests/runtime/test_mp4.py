"""`xstage_dit.runtime.mp4`: the one MP4 encoder (generate and the server): the same bytes whole or in chunks,
odd sides padded, uint8 only, and `save_output` writing exactly those bytes."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from xstage_dit.runtime.generation import read_mp4, save_output
from xstage_dit.runtime.mp4 import Mp4Writer, encode_mp4


def _frames(num=9, height=32, width=48, seed=0):
    y, x = np.mgrid[0:height, 0:width]
    rng = np.random.default_rng(seed)
    base = np.stack([(x * 5) % 256, (y * 7) % 256, (x + y) % 256], -1)
    return np.stack([(base + 9 * t + rng.integers(0, 3, base.shape)) % 256 for t in range(num)]).astype(np.uint8)


def test_chunks_and_whole_give_the_same_bytes():
    frames = _frames()
    writer = Mp4Writer(8)
    for part in (frames[:1], frames[1:5], frames[5:]):  # Wan's decoder: 1 frame, then 4 per latent frame
        writer.add(part)
    assert writer.frames == 9
    data = writer.close()
    assert data == encode_mp4(frames, 8) and data[4:8] == b"ftyp"
    decoded = read_mp4(data)
    assert decoded.shape == frames.shape
    assert np.abs(decoded.astype(float) - frames).mean() < 8  # lossy (yuv420p halves the chroma), but these frames


def test_odd_sides_are_padded_and_floats_refused():
    assert read_mp4(encode_mp4(_frames(3, 33, 47), 8)).shape == (3, 34, 48, 3)
    with pytest.raises(ValueError, match="expected uint8 frames of shape .* got float32 \\(3, 32, 48, 3\\)"):
        encode_mp4(_frames(3).astype(np.float32) / 255, 8)
    with pytest.raises(ValueError, match="at least one frame"):
        Mp4Writer(8).close()


def test_an_aborted_writer_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    writer = Mp4Writer(8)
    writer.add(_frames(2))
    assert len(list(tmp_path.glob("*.mp4"))) == 1
    writer.abort()
    writer.abort()
    assert list(tmp_path.glob("*.mp4")) == []


def test_save_output_writes_the_encoder_bytes(tmp_path):
    frames = _frames()
    path = save_output([Image.fromarray(f) for f in frames], tmp_path / "v.mp4", kind="video", fps=8)
    assert path.read_bytes() == encode_mp4(frames, 8)
