"""`xstage_dit.server.inprocess.serve_pipeline`, the server the benchmarks time: it must answer as fast as the
server `xstage-dit serve` runs (no transport delay of its own), and serve what the pipeline makes."""

from __future__ import annotations

import socket
import statistics
import time

import httpx

from tests.helpers.server import one_torch_thread, tiny
from xstage_dit.families import model_spec
from xstage_dit.server.inprocess import loopback_listener, serve_pipeline


def test_the_listener_turns_nagle_off():
    """asyncio disables Nagle only on sockets whose protocol says TCP: `socket.socket()` says 0."""
    sock = loopback_listener()
    try:
        assert sock.proto == socket.IPPROTO_TCP
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        host, port = sock.getsockname()
        assert host == "127.0.0.1" and port > 0
    finally:
        sock.close()


def test_a_post_is_answered_without_a_delayed_ack_stall():
    """Keep-alive POSTs (the served contender's requests) round-trip in a few ms. With Nagle on, each answer's
    body waited for the client's delayed ACK: >= 40 ms (Linux's minimum delayed ACK), 42-46 ms measured."""
    pipe, served = tiny("tiny-flux")
    with one_torch_thread(), serve_pipeline(pipe, served.name, model_spec(served.name), warmup=False) as (url, _):
        with httpx.Client(base_url=url, timeout=30) as client:
            times = []
            for _ in range(9):
                started = time.perf_counter()
                # A size the server refuses (422): the whole HTTP path, no pipeline work.
                r = client.post("/v1/images/generations", json={"prompt": "a cat", "size": "8x8"})
                times.append(time.perf_counter() - started)
                assert r.status_code == 422, r.text
    assert statistics.median(times) < 0.030, [round(t * 1e3, 1) for t in times]
