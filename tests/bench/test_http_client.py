"""`bench.http_client.JsonClient`: the served rows' client reads the whole answer with its headers, keeps the
connection only briefly, and refuses a URL it cannot use."""

from __future__ import annotations

import json
import os

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from xstage_dit.bench import http_client
from xstage_dit.bench.http_client import JsonClient
from xstage_dit.server.inprocess import uvicorn_thread

BODY = os.urandom(3_000_001)  # about a 1024² PNG of noise, an odd length


async def _echo(request: Request) -> Response:
    sent = await request.json()
    close = {"connection": "close"} if sent.get("close") else {}
    # the client's port tells the test whether a connection was reused
    return Response(BODY, media_type="image/png", headers={"x-timings": json.dumps(sent), "x-peer":
                                                          str(request.client.port), **close})


@pytest.fixture(scope="module")
def url():
    app = Starlette(routes=[Route("/img", _echo, methods=["POST"])])
    with uvicorn_thread(app, name="test-json-client") as port:
        yield f"http://127.0.0.1:{port}"


def test_the_whole_answer_arrives_with_its_headers(url):
    client = JsonClient(url)
    status, headers, content = client.post("/img", {"prompt": "a fox", "seed": 3})
    client.close()
    assert status == 200 and content == BODY and headers["content-type"] == "image/png"
    assert json.loads(headers["x-timings"]) == {"prompt": "a fox", "seed": 3}


def test_the_connection_is_reused_only_soon_after_an_answer(url, monkeypatch):
    client = JsonClient(url)
    peers = [client.post("/img", {})[1]["x-peer"] for _ in range(2)]
    assert peers[0] == peers[1]  # back to back: one connection
    monkeypatch.setattr(http_client, "REUSE_S", 0.0)  # every gap now counts as long
    assert client.post("/img", {})[1]["x-peer"] != peers[1]
    monkeypatch.undo()
    first = client.post("/img", {"close": True})[1]["x-peer"]  # the server says it closes: a new one next
    assert client._conn is None and client.post("/img", {})[1]["x-peer"] != first
    client.close()


@pytest.mark.parametrize("bad", ["https://127.0.0.1:1", "127.0.0.1:8000", "http://"])
def test_a_url_it_cannot_use_is_named(bad):
    with pytest.raises(ValueError, match="expected an http://host"):
        JsonClient(bad)
