"""The PNG encoder (models.png): Pillow decodes exactly the pixels it was given, for awkward shapes and every
channel count; the bytes depend only on the pixels; it is faster than Pillow's default save."""

from __future__ import annotations

import io
import sys
import time

import numpy as np
import pytest
from PIL import Image

from xstage_dit.runtime.png import STRIPE_ROWS, encode_png
from xstage_dit.server.media import png_bytes


def best_of(fn, n: int = 3) -> float:
    """The fastest of n timed calls of fn, in seconds."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _decoded(data: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(data))
    image.load()
    array = np.asarray(image)
    return array[..., None] if array.ndim == 2 else array


@pytest.mark.parametrize("shape", [(1, 1, 3), (1, 7, 3), (3, 1, 1), (STRIPE_ROWS, 5, 3), (STRIPE_ROWS + 1, 33, 4),
                                   (2 * STRIPE_ROWS + 17, 19, 2), (517, 300, 3), (64, 64, 1)])
def test_pillow_reads_back_the_exact_pixels(shape):
    rng = np.random.default_rng(sum(shape))
    pixels = rng.integers(0, 256, size=shape, dtype=np.uint8)
    assert np.array_equal(_decoded(encode_png(pixels)), pixels)


def test_smooth_image_round_trips_and_compresses():
    y, x = np.mgrid[0:600, 0:900]
    pixels = np.stack([(x // 3) % 256, (y // 3) % 256, ((x + y) // 5) % 256], -1).astype(np.uint8)
    data = encode_png(pixels)
    assert np.array_equal(_decoded(data), pixels)
    assert len(data) < pixels.nbytes / 4  # the Sub filter leaves small differences that deflate well


def test_bytes_depend_only_on_pixels():
    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 256, size=(700, 129, 3), dtype=np.uint8)
    assert encode_png(pixels) == encode_png(pixels.copy())
    other = pixels.copy()
    other[699, 128, 2] ^= 1
    assert encode_png(other) != encode_png(pixels)


def test_float_pixels_follow_the_one_rounding_rule():
    pixels = np.array([[[0.0, 0.5, 1.0], [0.2, 1.3, -0.1]]], dtype=np.float32)
    assert np.array_equal(_decoded(png_bytes(pixels)), np.array([[[0, 128, 255], [51, 255, 0]]], dtype=np.uint8))


@pytest.mark.parametrize("bad, needle", [(np.zeros((4, 4), np.uint8), "(4, 4)"), (np.zeros((4, 4, 5), np.uint8), "5"),
                                         (np.zeros((0, 4, 3), np.uint8), "(0, 4, 3)"),
                                         (np.zeros((4, 4, 3), np.int32), "int32")])
def test_bad_input_names_the_value(bad, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        encode_png(bad)


def test_faster_than_pillow_default_on_a_1024_image():
    """The reason this encoder exists (module docstring): the request's critical path."""
    y, x = np.mgrid[0:1024, 0:1024]
    rng = np.random.default_rng(0)
    pixels = np.clip(np.stack([(x / 4) % 256, (y / 4) % 256, ((x + y) / 8) % 256], -1)
                     + rng.integers(-3, 4, (1024, 1024, 3)), 0, 255).astype(np.uint8)

    ours = best_of(lambda: encode_png(pixels))
    pillow = best_of(lambda: Image.fromarray(pixels).save(io.BytesIO(), format="PNG"))
    assert ours < pillow / 2, f"expected our encoder well under Pillow's {pillow:.3f} s, got {ours:.3f} s"


def test_incompressible_stripes_are_stored_and_read_back():
    """Noise (what random weights make) does not deflate: such stripes are stored, which is smaller than
    deflating them and several times faster; smooth stripes beside them still compress."""
    from xstage_dit.runtime import png

    rng = np.random.default_rng(5)
    noise = rng.integers(0, 256, size=(1024, 1024, 3), dtype=np.uint8)
    y, x = np.mgrid[0:512, 0:1024]
    smooth = np.stack([(x // 3) % 256, (y // 3) % 256, ((x + y) // 5) % 256], -1).astype(np.uint8)
    mixed = np.concatenate([noise[:512], smooth])
    for pixels in (noise, mixed):
        assert np.array_equal(_decoded(encode_png(pixels)), pixels)
    raw = noise.nbytes + noise.shape[0]  # the pixels plus a filter byte a row
    stored = encode_png(noise)
    assert raw < len(stored) < raw * 1.01  # stored blocks: a few bytes of framing per 64 KB
    assert len(encode_png(mixed)) < 0.6 * mixed.nbytes  # the smooth half compressed

    fast = best_of(lambda: encode_png(noise))
    original = png._incompressible
    try:
        png._incompressible = lambda stripe: False  # deflate every stripe, as before
        deflated = encode_png(noise)
        slow = best_of(lambda: encode_png(noise))
    finally:
        png._incompressible = original
    assert len(stored) < len(deflated)
    assert fast < slow / 2, f"expected storing noise well under deflating it ({slow:.4f} s), got {fast:.4f} s"


@pytest.mark.parametrize("n", [1, 65534, 65535, 65536, 2 * 65535, 200_001])
def test_stored_blocks_frame_any_length(n):
    """The stored blocks framed by hand (views, no copy) are deflate's: stdlib zlib inflates them to the bytes,
    the stream's last block final, a stripe before it left open for the next one."""
    import zlib

    from xstage_dit.runtime import png

    data = np.random.default_rng(n).integers(0, 256, size=n, dtype=np.uint8).tobytes()
    assert zlib.decompress(b"".join(png._stored(memoryview(data), last=True)), -15) == data
    inflate = zlib.decompressobj(-15)
    assert inflate.decompress(b"".join(png._stored(memoryview(data), last=False))) == data
    assert not inflate.eof  # not final: the next stripe continues the stream
    assert inflate.decompress(b"".join(png._stored(memoryview(b"tail"), last=True))) == b"tail" and inflate.eof


def test_a_stored_png_is_a_strictly_valid_zlib_stream():
    """stdlib zlib (which checks the final block and the Adler-32) inflates the IDAT of a noise PNG, stored
    stripes all, to the filtered rows."""
    import struct
    import zlib

    from xstage_dit.runtime import png

    noise = np.random.default_rng(9).integers(0, 256, size=(2 * STRIPE_ROWS + 3, 700, 3), dtype=np.uint8)
    data = encode_png(noise)
    size, tag = struct.unpack(">I4s", data[33:41])  # after the signature and IHDR
    assert tag == b"IDAT"
    assert zlib.decompress(data[41:41 + size]) == png._filtered_rows(noise).tobytes()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts page faults with getrusage (Linux)")
def test_a_served_image_is_copied_once_not_once_per_chunk():
    """The server encodes on its own thread, a request at a time: there every fresh multi-megabyte bytes object
    is mapped anew, and each copy of the image costs a page fault per 4 KB (on the 2-core machine, chaining
    `+` over the chunks made 3980 faults and 7.0 ms an encode of 1024² noise; one join: 242 and 1.3 ms). Fewer
    than two copies' worth of faults an encode, and the same bytes as the chunks written out one by one."""
    import concurrent.futures
    import resource
    import struct
    import zlib

    rng = np.random.default_rng(3)
    noise = rng.integers(0, 256, size=(1024, 1024, 3), dtype=np.uint8)
    data = encode_png(noise)
    chunks, at = [], 8
    while at < len(data):  # the file's chunks, each re-framed on its own: length, tag, body, CRC of tag + body
        size, tag = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + size]
        chunks.append(struct.pack(">I", size) + tag + body + struct.pack(">I", zlib.crc32(tag + body)))
        at += 12 + size
    assert data == data[:8] + b"".join(chunks)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="encode-like-the-server") as thread:
        def faults_of_one() -> int:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            encode_png(noise)
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

        faults = []
        for _ in range(8):
            faults.append(thread.submit(faults_of_one).result())
            time.sleep(0.02)  # requests arrive apart
    copy_pages = noise.nbytes // 4096
    assert sorted(faults)[len(faults) // 2] < 2 * copy_pages, faults
