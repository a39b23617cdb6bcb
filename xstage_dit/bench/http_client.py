"""The benchmarks' HTTP client for image requests: stdlib ``http.client``, the connection kept briefly.

    client = JsonClient("http://127.0.0.1:8000", timeout_s=3600.0)
    status, headers, content = client.post("/v1/images/generations", {"prompt": "a fox", "response_format": "png"})

Why not httpx (what the served rows used before): its pure-Python HTTP/1.1 parser (h11) copies a large body in
64 KB pieces, and in the benchmark that client runs in the server's own process, on the GIL the server's threads
need. A multi-megabyte answer arrived several times slower through httpx than through ``http.client`` (which
reads a known-length body with C-level reads) from the same in-process uvicorn (benchmarks/results/serving/NOTES.md,
"After these calls"). ``requests`` / ``urllib3``, what most Python clients use, read bodies through
``http.client`` too, so these rows now time what such a client waits for. The connection is kept for the next
request only within ``REUSE_S`` of the last answer: uvicorn closes an idle one after 5 s, and a POST that makes
an image is not one to send twice after finding it closed (a new connection is cheap on loopback).
"""

from __future__ import annotations

import http.client
import json
import time
from typing import Any
from urllib.parse import urlsplit

__all__ = ["JsonClient", "REUSE_S"]

REUSE_S = 2.0  # keep a connection this long after an answer (uvicorn's keep-alive timeout: 5 s)


class JsonClient:
    """POST JSON to one server and read the whole answer."""

    def __init__(self, base_url: str, timeout_s: float = 3600.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected an http://host[:port] base URL, got {base_url!r}")
        self.host, self.port, self.timeout_s = parts.hostname, parts.port or 80, timeout_s
        self._conn: http.client.HTTPConnection | None = None
        self._last = 0.0  # time.monotonic() of the last answer

    def post(self, path: str, body: Any) -> tuple[int, dict[str, str], bytes]:
        """(status, headers with lower-case names, the whole body) of ``POST path`` with `body` as JSON."""
        if self._conn is not None and time.monotonic() - self._last > REUSE_S:
            self.close()
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            self._conn.request("POST", path, body=json.dumps(body).encode(),
                               headers={"Content-Type": "application/json"})
            response = self._conn.getresponse()
            content = response.read()
        except BaseException:
            self.close()
            raise
        self._last = time.monotonic()
        if response.will_close:
            self.close()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, content

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
