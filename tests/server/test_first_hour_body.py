"""Issue 16, item 1: a request body over the limit gets a readable 413 from every common client, at
1, 5, 20 and 100 MiB, against a real uvicorn server; and the refused body is never held whole in memory."""

from __future__ import annotations

import json
import socket
import tracemalloc
import urllib.error
import urllib.request

import httpx
import pytest

from xstage_dit.server.app import create_app
from xstage_dit.server.config import ServerConfig
from tests.helpers.server import live_server, one_torch_thread, start_worker

MIB = 1 << 20
SIZES_MIB = (1, 5, 20, 100)
PATH = "/v1/images/generations"


@pytest.fixture(scope="module")
def url():
    with one_torch_thread():
        worker = start_worker(ServerConfig(max_batch_size=1, api_key=None))
        try:
            with live_server(create_app(worker)) as base:
                yield base
        finally:
            worker.stop()


@pytest.fixture(scope="module")
def bodies():
    return {mib: b" " * (mib * MIB) for mib in SIZES_MIB}


def _assert_413(status: int, payload: bytes, what: str) -> None:
    assert status == 413, f"{what}: expected 413, got {status}"
    error = json.loads(payload)["error"]
    assert error["param"] == "body" and error["code"] == 413 and "expected at most" in error["message"], error


@pytest.mark.parametrize("mib", SIZES_MIB)
def test_urllib_reads_the_413(url, bodies, mib):
    request = urllib.request.Request(url + PATH, data=bodies[mib], headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    _assert_413(info.value.code, info.value.read(), f"urllib {mib} MiB")


@pytest.mark.parametrize("mib", SIZES_MIB)
def test_httpx_reads_the_413(url, bodies, mib):
    r = httpx.post(url + PATH, content=bodies[mib], headers={"Content-Type": "application/json"}, timeout=60)
    _assert_413(r.status_code, r.content, f"httpx {mib} MiB")


def _raw_post(url: str, length: int, piece: bytes = b" " * (64 * 1024), extra: bytes = b"") -> bytes:
    """Writes the whole body before reading anything (as urllib does); returns the raw answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(f"POST {PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {length}\r\n".encode() + extra + b"\r\n")
        sent = 0
        while sent < length:
            chunk = piece[: length - sent]
            s.sendall(chunk)
            sent += len(chunk)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _content_length(answer):
            data = s.recv(65536)
            if not data:
                break
            answer += data
    return answer


def _content_length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


@pytest.mark.parametrize("mib", SIZES_MIB)
def test_raw_socket_reads_the_413(url, mib):
    answer = _raw_post(url, mib * MIB)
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    _assert_413(status, body, f"raw socket {mib} MiB")
    # The whole body was read: the connection stays usable (no 'Connection: close').
    assert b"connection: close" not in head.lower(), head


def test_a_client_that_waits_for_100_continue_gets_the_413_without_sending():
    # Nothing is drained for it: it never sends the body, so the answer comes at once.
    with one_torch_thread():
        worker = start_worker(ServerConfig(max_batch_size=1, api_key=None))
        try:
            with live_server(create_app(worker)) as base:
                host, port = base.removeprefix("http://").split(":")
                with socket.create_connection((host, int(port)), timeout=10) as s:
                    s.sendall(f"POST {PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                              f"Content-Length: {100 * MIB}\r\nExpect: 100-continue\r\n\r\n".encode())
                    answer = s.recv(65536)
        finally:
            worker.stop()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert b"connection: close" in head.lower()


def test_a_100_mib_body_is_drained_not_buffered(url):
    # The client reuses one 64 KiB piece, so what tracemalloc sees is the server's side.
    tracemalloc.start()
    try:
        answer = _raw_post(url, 100 * MIB)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert peak < 8 * MIB, f"expected the refused body drained in pieces, got a peak of {peak / MIB:.1f} MiB"


def test_a_chunked_body_over_the_limit_is_drained_then_refused(url):
    def pieces():
        for _ in range(5 * 16):  # 5 MiB, no Content-Length
            yield b" " * 65536

    r = httpx.post(url + PATH, content=pieces(), headers={"Content-Type": "application/json"}, timeout=60)
    _assert_413(r.status_code, r.content, "chunked 5 MiB")
