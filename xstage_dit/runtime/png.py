"""PNG bytes of generated pixels, fast enough to sit on a request's critical path.

    data = encode_png(pixels)         # pixels: (H, W, C) uint8, C in 1, 2, 3, 4 (floats: `generation.to_uint8` first)

Why not Pillow's ``Image.save(format="PNG")``: its adaptive per-row filter search plus zlib level 6 runs on
one core, a visible share of a whole request, paid after the GPU finished. Here every row gets PNG's "Sub"
filter (one numpy subtraction: generated images are smooth, so horizontal differences are small), and the
filtered rows are deflated at level 1 in stripes of ``STRIPE_ROWS`` rows on a thread pool (the deflate
releases the GIL), each stripe ending on a sync flush so the stripes concatenate into one valid zlib stream
(the way pigz does). The deflate is zlib-ng's (``zlib-ng``, the zlib API over zlib-ng, pinned): faster than
stdlib zlib's on noise and on smooth images for a few percent more bytes, and so are its SIMD CRC-32 and
Adler-32.

A stripe that does not compress is stored instead (deflate's stored blocks, level 0): before deflating, three
8 KB samples of the filtered stripe (start, middle, end) are deflated; when none comes out under 97 % of its
size, the stripe is stored. Noise (what random weights make) grows under level-1 deflate, and stored it is
smaller and far faster; a smooth stripe's samples compress, so it deflates as before, for a little sampling.
Stored blocks are framed here as views of the filtered rows (`_stored`), so a noise PNG's bytes are copied
once, by the final join.

The timings of each choice (Pillow, stdlib zlib, zlib-ng, stored vs deflated, the copies):
benchmarks/results/serving/png-encode-cpu-2core.md, NOTES.md there ("The PNG of noise: stored, not deflated",
"The PNG assembled in one join") and benchmarks/results/figures-from-code.md ("runtime/png.py").

The bytes depend only on the pixels (the stripe size is fixed, not the thread count; the store decision reads
only the stripe), so ``xstage-dit generate`` and the server write the same file for the same image. Any PNG
decoder reads them; the tests decode them with Pillow.
"""

from __future__ import annotations

import concurrent.futures
import os
import struct
import threading

import numpy as np
from zlib_ng import zlib_ng

__all__ = ["encode_png", "png_parts", "STRIPE_ROWS"]

STRIPE_ROWS = 128  # rows per independently deflated stripe: 8 for a 1024-row image (the H200 host has 16 cores)
_LEVEL = 1
_SAMPLE_BYTES = 8192  # each of a stripe's three compressibility samples
_STORE_ABOVE = 0.97  # samples that all deflate to more than this fraction of their size: store the stripe
_SUB = 1  # PNG filter type "Sub": each byte minus the byte one pixel to its left
_STORED_MAX = 65535  # bytes of one stored deflate block (its LEN is 16 bits)
_COLOR_TYPE = {1: 0, 2: 4, 3: 2, 4: 6}  # channels -> PNG colour type (grey, grey+alpha, RGB, RGBA)
_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()  # the server encodes on two threads: one pool for both, made once


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                                          thread_name_prefix="xstage-png")
        return _POOL


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib_ng.crc32(data, zlib_ng.crc32(tag)))


def _filtered_rows(pixels: np.ndarray) -> np.ndarray:
    """(H, W, C) uint8 -> (H, 1 + W*C) uint8: each row's filter byte, then its Sub-filtered bytes."""
    height, width, channels = pixels.shape
    rows = pixels.reshape(height, width * channels)
    out = np.empty((height, 1 + width * channels), dtype=np.uint8)
    out[:, 0] = _SUB
    out[:, 1:1 + channels] = rows[:, :channels]
    np.subtract(rows[:, channels:], rows[:, :-channels], out=out[:, 1 + channels:])  # uint8 wraps mod 256
    return out


def _incompressible(stripe: memoryview) -> bool:
    """True when three samples of the stripe (start, middle, end) all deflate to over `_STORE_ABOVE` of their
    size: deflating the whole stripe would cost milliseconds and save nothing."""
    n = len(stripe)
    if n < 4 * _SAMPLE_BYTES:
        return False  # a small stripe: deflating it is cheap anyway
    starts = (0, (n - _SAMPLE_BYTES) // 2, n - _SAMPLE_BYTES)
    return all(len(zlib_ng.compress(stripe[a:a + _SAMPLE_BYTES], _LEVEL, -15)) > _STORE_ABOVE * _SAMPLE_BYTES
               for a in starts)


def _deflate(stripe: memoryview, last: bool) -> list:
    """The stripe's piece(s) of the raw deflate stream, ending byte-aligned (the next stripe starts there)."""
    if _incompressible(stripe):
        return _stored(stripe, last)
    co = zlib_ng.compressobj(_LEVEL, zlib_ng.DEFLATED, -15)  # raw deflate: the zlib header is written once
    return [co.compress(stripe) + co.flush(zlib_ng.Z_FINISH if last else zlib_ng.Z_SYNC_FLUSH)]


def _stored(stripe: memoryview, last: bool) -> list:
    """Deflate's stored blocks over `stripe`, framed here: each block a 5-byte header (BFINAL on the stream's last
    one, type 00, then LEN and its complement, little-endian) and a view of up to 65535 of the stripe's bytes. No
    copy until the PNG's one join: zlib at level 0 copied each stripe twice (its output, then the flush appended),
    a large share of a noise PNG's encode, more on hosts where fresh pages fault slowly
    (benchmarks/results/figures-from-code.md, "runtime/png.py")."""
    pieces = []
    for at in range(0, len(stripe), _STORED_MAX):
        block = stripe[at:at + _STORED_MAX]
        final = last and at + _STORED_MAX >= len(stripe)
        pieces += [struct.pack("<BHH", int(final), len(block), 0xFFFF ^ len(block)), block]
    return pieces


def encode_png(pixels: np.ndarray) -> bytes:
    """pixels: (height, width, channels) uint8, channels 1-4 (grey, grey+alpha, RGB, RGBA) -> the bytes of an
    8-bit PNG of them."""
    header, stream = png_parts(pixels)
    crc = zlib_ng.crc32(b"IDAT")
    for part in stream:  # the IDAT chunk's CRC, piece by piece: the stream is never joined on its own
        crc = zlib_ng.crc32(part, crc)
    # One join: the image's bytes are copied once. Chaining `+` over the chunks (before 0a74973) copied them five
    # times, each copy page-faulting anew on the server's encode thread (`bench_serving.py png`).
    return b"".join([_SIGNATURE, _chunk(b"IHDR", header), struct.pack(">I", sum(len(p) for p in stream)), b"IDAT",
                     *stream, struct.pack(">I", crc), _chunk(b"IEND", b"")])


def png_parts(pixels: np.ndarray) -> tuple[bytes, list]:
    """What a PNG of `pixels` (as `encode_png` takes them) holds: the IHDR chunk's body, and the zlib stream of
    the IDAT chunk as bytes-like pieces in order (header, each stripe's deflate or stored blocks, Adler-32 of all
    raw bytes); stored blocks are views of the filtered rows, valid until the pieces are dropped."""
    pixels = np.asarray(pixels)
    if pixels.ndim != 3 or pixels.shape[-1] not in _COLOR_TYPE or 0 in pixels.shape:
        raise ValueError(f"expected an image of shape (height, width, 1|2|3|4) with height, width >= 1, got "
                         f"{tuple(pixels.shape)}")
    if pixels.dtype != np.uint8:
        raise ValueError(f"expected uint8 pixels (round floats with generation.to_uint8), got dtype {pixels.dtype}")
    pixels = np.ascontiguousarray(pixels)
    height, width, channels = pixels.shape
    raw = _filtered_rows(pixels)
    flat = memoryview(raw.reshape(-1))
    row_bytes = raw.shape[1]
    starts = list(range(0, height, STRIPE_ROWS))
    stripes = [flat[s * row_bytes:min(s + STRIPE_ROWS, height) * row_bytes] for s in starts]
    lasts = [i == len(stripes) - 1 for i in range(len(stripes))]
    if len(stripes) == 1:
        pieces = _deflate(stripes[0], True)
    else:
        pieces = [piece for stripe in _pool().map(_deflate, stripes, lasts) for piece in stripe]
    # zlib stream: header (deflate, 32K window, fastest), the concatenated stripes, Adler-32 of all raw bytes.
    header = struct.pack(">IIBBBBB", width, height, 8, _COLOR_TYPE[channels], 0, 0, 0)
    return header, [b"\x78\x01", *pieces, struct.pack(">I", zlib_ng.adler32(flat))]
