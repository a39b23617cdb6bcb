"""Encode a video while its VAE still decodes it: the MP4 off the request's critical path.

A served video request used to end with the pipeline call (denoising, then the VAE decoding every frame), then the
MP4 encode of all frames, over issue 15's 2 % budget for serving over the bare call on its own (the timings:
benchmarks/results/serving/NOTES.md, "the video encode off the critical path"). Wan's VAE
(``AutoencoderKLWan``) decodes one latent frame at a time (1 video frame, then 4 per
latent frame, its causal cache carried between calls of ``vae.decoder``); its decode of 81 frames takes seconds.
`StreamedVideo` hooks ``vae.decoder``: each chunk it returns is post-processed the way the pipeline will
post-process the whole video (the pipeline's own ``video_processor``, then `runtime.generation.to_uint8_tensor`),
copied to the host without a synchronization, and handed to a thread that feeds x264 (`runtime.mp4.Mp4Writer`,
its own process) as soon as the copy has landed. When the pipeline returns, the encoder has the frames but the
last few; `StreamedVideo.finish` checks that the frames it encoded are the pipeline's output, byte for byte, and
returns the MP4 (else None and a logged reason: the caller encodes the output as before).

Only where a decoder call is a run of whole frames (`streams`: the family record's ``VideoVAEFacts.streams_frames``,
Wan's ``AutoencoderKLWan``), without tiling (tiles are parts of frames) and without a patch size (Wan 2.2 5B
unpatchifies after the loop), one video per call. The
server asks for it per its ``ServerConfig.video_stream`` (``--video-stream``): by default only where the
pipeline runs on a GPU, since on a 2-core CPU machine, where the VAE decodes on the same cores as x264, it made
the request slower (same notes).
"""

from __future__ import annotations

import logging
import queue
import threading

import numpy as np
import torch

from xstage_dit.families.registry import video_vae_facts
from xstage_dit.runtime.generation import to_uint8_tensor
from xstage_dit.runtime.mp4 import Mp4Writer

log = logging.getLogger(__name__)

_DONE = object()


def streams(pipe) -> bool:
    """Whether `pipe`'s VAE decodes a video in calls of whole frames, in order (see the module docstring)."""
    vae = getattr(pipe, "vae", None)
    decoder = getattr(vae, "decoder", None)
    facts = video_vae_facts(vae)  # its family record: a VAE whose decoder calls return whole frames (Wan's)
    return (facts is not None and facts.streams_frames and isinstance(decoder, torch.nn.Module)
            and not getattr(vae, "use_tiling", False) and getattr(vae.config, "patch_size", None) is None
            and hasattr(pipe, "video_processor"))


class StreamedVideo:
    """The MP4 of one video pipeline call, encoded while the call runs (see the module docstring).

        stream = StreamedVideo(pipe, fps)       # hooks pipe.vae.decoder
        try:
            out = pipe(...)                     # each decoded chunk is encoded meanwhile
        finally:
            stream.detach()                     # the hook off, whatever happened
        data = stream.finish(pixels[0])         # MP4 bytes, or None where the stream is not the output

    ``abort()`` drops it (a stopped or failed call). Not for several videos at once: `streams` and one item a call.
    """

    def __init__(self, pipe, fps: int):
        self._processor = pipe.video_processor
        self._chunks: list[torch.Tensor] = []  # host uint8 (frames, H, W, 3), kept to check against the output
        self._queue: queue.Queue = queue.Queue()
        self._writer = Mp4Writer(fps)
        self._problem: str | None = None
        self._thread = threading.Thread(target=self._encode, name="xstage-video-stream", daemon=True)
        self._thread.start()
        self._hook = pipe.vae.decoder.register_forward_hook(self._on_chunk)

    def _on_chunk(self, module, args, output) -> None:
        if self._problem is not None:
            return
        if not isinstance(output, torch.Tensor) or output.ndim != 5 or output.shape[0] != 1:
            self._problem = f"expected decoder chunks of shape (1, C, frames, H, W), got {_shape(output)}"
            return
        with torch.inference_mode():
            # As the pipeline will do to the whole video: the VAE's clamp, its processor, the one rounding rule.
            frames = self._processor.postprocess_video(output.clamp(-1.0, 1.0), output_type="pt")[0]
            frames = to_uint8_tensor(frames).permute(0, 2, 3, 1)  # (frames, H, W, C)
            host = frames.to("cpu", non_blocking=True)  # pinned from a GPU: no wait for the decoder here
            ready = None
            if frames.is_cuda:
                ready = torch.cuda.Event()
                ready.record()
        self._chunks.append(host)
        self._queue.put((host, ready))

    def _encode(self) -> None:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if self._problem is not None:
                continue
            host, ready = item
            try:
                if ready is not None:
                    ready.synchronize()  # this thread waits for the copy; the pipeline's thread never does
                self._writer.add(host.numpy())
            except Exception as exc:  # noqa: BLE001 - reported by finish(), the output is encoded instead
                self._problem = f"the encoder failed: {type(exc).__name__}: {exc}"

    def detach(self) -> None:
        """Remove the decoder hook (idempotent); the encoder thread goes on with what it has."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def finish(self, pixels: np.ndarray) -> bytes | None:
        """pixels: (frames, H, W, 3) uint8, the call's output. The MP4 of the streamed frames when they are
        exactly `pixels`; None otherwise (the reason logged), the stream dropped either way."""
        self.detach()
        self._queue.put(_DONE)
        self._thread.join()
        try:
            if self._problem is None:
                self._problem = _mismatch(self._chunks, pixels)
            if self._problem is None:
                try:
                    return self._writer.close()
                except Exception as exc:  # noqa: BLE001 - the output is encoded instead
                    self._problem = f"the encoder failed at the end: {type(exc).__name__}: {exc}"
            log.warning("video stream not used (the output is encoded after the call): %s", self._problem)
            return None
        finally:
            self._writer.abort()
            self._chunks = []

    def abort(self) -> None:
        """Drop the stream (a stopped or failed call); idempotent."""
        self.detach()
        self._problem = self._problem or "aborted"
        self._queue.put(_DONE)
        self._thread.join()
        self._writer.abort()
        self._chunks = []


def _shape(value) -> str:
    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def _mismatch(chunks: list[torch.Tensor], pixels: np.ndarray) -> str | None:
    """Why the streamed chunks are not `pixels` (None when they are, byte for byte)."""
    streamed = sum(int(c.shape[0]) for c in chunks)
    if streamed != pixels.shape[0] or any(tuple(c.shape[1:]) != pixels.shape[1:] for c in chunks):
        shapes = sorted({tuple(c.shape[1:]) for c in chunks})
        return (f"expected the streamed frames to be the output's {tuple(pixels.shape)}, got {streamed} frames "
                f"of {shapes}")
    start = 0
    for chunk in chunks:
        stop = start + int(chunk.shape[0])
        if not np.array_equal(chunk.numpy(), pixels[start:stop]):
            return f"expected the streamed frames to equal the output, frames {start}-{stop - 1} differ"
        start = stop
    return None
