"""What the server's PNG encode costs where the server runs it: on its own thread, one request at a time.

The encoder once assembled its file by chaining ``+`` over the chunks, five copies of the image's bytes; on a
thread that encodes one image now and then, each fresh multi-megabyte bytes object is mapped anew, so every copy
page-faults once per 4 KB (the H200 host's served NucleusMoE calls spent 8.6-9.1 ms encoding a 1024² PNG of noise
that stores in about 1 ms). This times, in the same run, ``runtime.png.encode_png`` (one join) against the same
stripes assembled the old way, each in a process of its own (as the server's), on one long-lived thread with
``--pause-ms`` between calls (as requests arrive), for 1024² noise (what random weights make) and a smooth 1024²
image: median ms and minor page faults a call; and the one join again with glibc told to keep freed memory
(`xstage_dit.runtime.malloc_heap`, what the server applies before its warm-up).

    python benchmarks/bench_serving.py png --out-dir benchmarks/results/serving --tag cpu-2core

Writes <out-dir>/png-encode-<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, when run as a script

from benchmarks._common import environment, write_results  # noqa: E402
from xstage_dit.runtime import png  # noqa: E402


def chained(pixels: np.ndarray) -> bytes:
    """The same stripes and bytes as `png.encode_png`, assembled as before 0a74973 (``+`` over the chunks)."""
    header, (zlib_header, *pieces, adler) = png.png_parts(pixels)
    stream = zlib_header + b"".join(pieces) + adler  # two copies, as it was
    return png._SIGNATURE + png._chunk(b"IHDR", header) + png._chunk(b"IDAT", stream) + png._chunk(b"IEND", b"")


def images(size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size]
    smooth = np.clip(np.stack([(x / 4) % 256, (y / 4) % 256, ((x + y) / 8) % 256], -1)
                     + rng.integers(-3, 4, (size, size, 3)), 0, 255).astype(np.uint8)
    return {"noise": rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8), "smooth": smooth}


ENCODERS = {"one join (encode_png)": "encode_png", "chained + (before 0a74973)": "chained",
            "one join, malloc keeps freed memory (runtime.malloc_heap)": "encode_png_kept"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--calls", type=int, default=30, help="calls per encoder, image and round (the first 3 untimed)")
    p.add_argument("--rounds", type=int, default=2, help="each encoder's process, alternating: A B A B")
    p.add_argument("--pause-ms", type=float, default=50.0, help="between calls, as requests arrive")
    p.add_argument("--out-dir", default="benchmarks/results/serving")
    p.add_argument("--tag", default="cpu", help="names the output (the machine it ran on)")
    p.add_argument("--worker", nargs=2, metavar=("ENCODER", "NPY"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.size < 1 or args.calls < 4 or args.pause_ms < 0 or args.rounds < 1:
        raise SystemExit(f"expected --size >= 1, --calls >= 4, --pause-ms >= 0, --rounds >= 1, got {args.size}, "
                         f"{args.calls}, {args.pause_ms}, {args.rounds}")
    if args.worker:
        return _worker(args)
    for image_name, pixels in images(args.size).items():
        if png.encode_png(pixels) != chained(pixels):
            raise RuntimeError(f"expected both encoders to write the same bytes for {image_name}")
    rows = []
    scratch = tempfile.TemporaryDirectory()
    for image_name, pixels in images(args.size).items():
        # The worker loads the image in one allocation: building it there would free large temporaries, which
        # raises glibc's mmap threshold and hides the very cost measured here (see `_worker`).
        path = Path(scratch.name) / f"{image_name}.npy"
        np.save(path, pixels)
        samples: dict[str, list] = {name: [] for name in ENCODERS}
        for _ in range(args.rounds):
            for name, func in ENCODERS.items():
                # A process of its own, as the server's: which allocations stay mapped depends on its history.
                out = subprocess.run([sys.executable, __file__, "--worker", func, str(path), "--calls", str(args.calls),
                                      "--pause-ms", str(args.pause_ms)],
                                     check=True, capture_output=True, text=True).stdout
                samples[name] += json.loads(out.strip().splitlines()[-1])
        for name, got in samples.items():
            rows.append({"image": f"{image_name} {args.size}x{args.size}", "encoder": name,
                         "median_ms": round(statistics.median(1e3 * s for s, _ in got), 3),
                         "min_ms": round(min(1e3 * s for s, _ in got), 3),
                         "faults_per_call": int(statistics.median(f for _, f in got)),
                         "bytes": len(png.encode_png(images(args.size)[image_name])), "calls": len(got)})
            print(rows[-1], flush=True)
    scratch.cleanup()
    summary = {r["image"] + ": " + r["encoder"]: r["median_ms"] for r in rows}
    write_results(Path(args.out_dir) / f"png-encode-{args.tag}", "png-encode", rows, summary,
                  ("image", "encoder", "median_ms", "min_ms", "faults_per_call", "bytes", "calls"),
                  notes=f"Each encoder in a process of its own ({args.rounds} rounds, alternating), on one long-lived "
                        f"thread, one call every {args.pause_ms:g} ms; median and fastest of the timed calls, minor "
                        "page faults a call (getrusage, the whole process). The encoders write the same bytes (checked).",
                  env=environment())
    return 0


def _worker(args) -> int:
    """One encoder's timed calls in this process; prints [[seconds, faults], ...] as the last line.

    Why a process with no large temporaries: glibc maps an allocation of at least its mmap threshold afresh
    (page faults on first touch) and raises the threshold to the size of a mapped block when one is freed. A
    PNG's copies are all about the image's size, so after freeing one the next one of the same size is still
    mapped afresh; after freeing something larger (a 16 MB temporary), they come from the heap, without faults.
    Which of the two a server is in depends on its history; the first is the one that costs."""
    encode = chained if args.worker[0] == "chained" else png.encode_png
    if args.worker[0] == "encode_png_kept":  # as the server from before its warm-up
        from xstage_dit.runtime.malloc_heap import keep_freed_memory

        kept = keep_freed_memory()
        if not kept["applied"]:
            raise RuntimeError(f"malloc_heap.keep_freed_memory did nothing here: {kept}")
    pixels = np.load(args.worker[1])
    got = []
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="xstage-encode") as thread:
        for i in range(args.calls):
            result = thread.submit(_timed, encode, pixels).result()
            if i >= 3:
                got.append(result)
            time.sleep(args.pause_ms / 1e3)
    print(json.dumps(got))
    return 0


def _timed(encode, pixels) -> tuple[float, int]:
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started = time.perf_counter()
    encode(pixels)
    return time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


if __name__ == "__main__":
    sys.exit(main())
