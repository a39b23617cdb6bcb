"""What the in-process server's transport adds to an answer, by answer size (issue 15: the served contenders
time requests through `xstage_dit.server.inprocess`, which must cost what `xstage-dit serve` costs).

One FastAPI app (answers of 100 B, 46 KB, 2.7 MB, 8 MB: an error, a tiny model's PNG, a 1024² PNG of
random-weight noise, a short MP4) served three ways in this process, each timed with keep-alive POSTs and
GETs from one httpx client (median of ``--reps`` round trips):

- ``uvicorn binds``: uvicorn's own ``host``/``port``, as ``xstage-dit serve`` runs;
- ``loopback_listener``: the socket ``serve_pipeline`` hands uvicorn now (IPPROTO_TCP, TCP_NODELAY);
- ``socket.socket()``: the socket it handed uvicorn before 88755df (protocol 0: asyncio left Nagle on).

    python benchmarks/bench_serving.py transport --out-dir benchmarks/results/serving

Writes <out-dir>/http-transport-<host tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from pathlib import Path

from benchmarks._common import environment, write_results

SIZES = (100, 46_000, 2_700_000, 8_000_000)


def _app():
    from fastapi import Body, FastAPI
    from fastapi.responses import Response

    blobs = {n: os.urandom(n) for n in SIZES}
    app = FastAPI()

    @app.post("/answer")
    async def post(size: int = Body(..., embed=True)):
        return Response(blobs[size], media_type="application/octet-stream")

    @app.get("/answer/{size}")
    async def get(size: int):
        return Response(blobs[size], media_type="application/octet-stream")

    return app


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out-dir", default="benchmarks/results/serving")
    p.add_argument("--tag", default="cpu", help="names the output (the machine it ran on)")
    args = p.parse_args(argv)
    import httpx

    from xstage_dit.server.inprocess import loopback_listener, uvicorn_thread

    def bound_zero():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        return sock

    ways = {"uvicorn binds": lambda: None, "loopback_listener": loopback_listener, "socket.socket()": bound_zero}
    app, rows = _app(), []
    for way, make in ways.items():
        sock = make()
        with uvicorn_thread(app, sock) as port:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                for size in SIZES:
                    row = {"listener": way, "answer_bytes": size}
                    for method, call in (("post", lambda: client.post("/answer", json={"size": size})),
                                         ("get", lambda: client.get(f"/answer/{size}"))):
                        times = []
                        for _ in range(args.reps):
                            started = time.perf_counter()
                            r = call()
                            times.append(1e3 * (time.perf_counter() - started))
                            if r.status_code != 200 or len(r.content) != size:
                                raise RuntimeError(f"expected 200 with {size} bytes, got {r.status_code}, "
                                                   f"{len(r.content)} bytes")
                        row[f"{method}_ms"] = round(statistics.median(times), 2)
                        row[f"{method}_ms_max"] = round(max(times), 2)
                    rows.append(row)
                    print(row, flush=True)
        if sock is not None:
            sock.close()
    by = {(r["listener"], r["answer_bytes"]): r for r in rows}
    summary = {f"{size}B_post_ms": {way: by[(way, size)]["post_ms"] for way in ways} for size in SIZES}
    write_results(Path(args.out_dir) / f"http-transport-{args.tag}", "http-transport", rows, summary,
                  ("listener", "answer_bytes", "post_ms", "post_ms_max", "get_ms", "get_ms_max"),
                  notes=f"Median (and largest) of {args.reps} keep-alive round trips from one httpx client in the "
                        f"same process, {os.cpu_count()} CPUs. The answer's body is random bytes.",
                  env=environment())
    return 0

