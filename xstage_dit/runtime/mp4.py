"""MP4 (H.264, yuv420p) bytes of generated frames: the one encoder of `xstage-dit generate` and the server.

    data = encode_mp4(frames, fps=16)   # frames: (num_frames, H, W, 3) uint8 (floats: `generation.to_uint8` first)

x264 runs in imageio-ffmpeg's ffmpeg binary (its own process), fed frame by frame; the bytes depend only on the
frames, the fps and the settings below, so a video written by `generate` is the one the server answers.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

# x264 at CRF 10 (imageio's quality 8, kept) with the veryfast preset instead of x264's default medium: the
# encode sits on every video request's critical path, after the GPU is done, and veryfast encodes several times
# faster for files of the same size or smaller (benchmarks/results/serving/NOTES.md, "Video: the MP4 encode";
# benchmarks/results/figures-from-code.md, "runtime/mp4.py").
X264_CRF = 10
X264_PRESET = "veryfast"


class Mp4Writer:
    """H.264 MP4 (yuv420p, CRF ``X264_CRF``, preset ``X264_PRESET``) written frame chunk by frame chunk: x264 runs
    in its own ffmpeg process, so chunks added while the GPU still decodes the rest are encoded meanwhile
    (`xstage_dit.server.video_stream`). ``close()`` returns the bytes; ``abort()`` drops them. `encode_mp4` is
    this writer over all frames at once, so both give the same bytes for the same frames."""

    def __init__(self, fps: int):
        self.fps = fps
        self._writer = None
        self._path = None
        self._pad = (0, 0)
        self.frames = 0

    def add(self, frames: np.ndarray) -> None:
        """frames: (num_frames, height, width, 3) uint8, the next frames of the video."""
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise ValueError(f"expected uint8 frames of shape (num_frames, height, width, 3), got "
                             f"{frames.dtype} {tuple(frames.shape)}")
        if self._writer is None:
            self._start(frames.shape[1], frames.shape[2])
        pad_h, pad_w = self._pad
        if pad_h or pad_w:  # yuv420p needs even sides; pad by edge replication rather than rescaling the content
            frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
        for frame in frames:
            self._writer.send(np.ascontiguousarray(frame))
        self.frames += len(frames)

    def _start(self, height: int, width: int) -> None:
        import imageio_ffmpeg  # the ffmpeg binary ships inside this wheel

        self._pad = (height % 2, width % 2)
        fd, self._path = tempfile.mkstemp(suffix=".mp4")
        os.close(fd)
        self._writer = imageio_ffmpeg.write_frames(
            self._path, (width + self._pad[1], height + self._pad[0]), fps=self.fps, codec="libx264",
            pix_fmt_in="rgb24", pix_fmt_out="yuv420p", macro_block_size=1, quality=None,
            output_params=["-crf", str(X264_CRF), "-preset", X264_PRESET, "-movflags", "+faststart"],
            ffmpeg_log_level="error")
        self._writer.send(None)

    def close(self) -> bytes:
        """Flush the encoder; the MP4's bytes."""
        if self._writer is None:
            raise ValueError("expected at least one frame before close(), got none")
        try:
            self._writer.close()
            self._writer = None
            with open(self._path, "rb") as f:
                return f.read()
        finally:
            self.abort()

    def abort(self) -> None:
        """Stop the encoder (if running) and delete its file; idempotent."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        path, self._path = self._path, None
        if path is not None and os.path.exists(path):
            os.unlink(path)


def encode_mp4(frames: np.ndarray, fps: int) -> bytes:
    """frames: (num_frames, height, width, 3) uint8 -> H.264 MP4 bytes (`Mp4Writer`)."""
    writer = Mp4Writer(fps)
    try:
        writer.add(frames)
        return writer.close()
    finally:
        writer.abort()
