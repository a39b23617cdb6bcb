"""The HTTP entry of a replica: the server's own FastAPI app (`server.app.create_app`, the routes and web page of
``xstage-dit serve``, unchanged), wrapped by `ReplicaIngress`, a pure-ASGI layer that makes one replica answer for
the whole deployment.

- Other replicas' video jobs: before a request naming a job (``/v1/videos/{id}...``, ``/v1/jobs/{id}...``) or
  listing videos reaches the app, the job's copy is fetched from the directory (`Mirror.resolve`, `Mirror.sync`);
  the app then answers from it as from a job of its own (state, events, MP4, cancel, delete). Image jobs are
  answered in their own request and are not shared.
- Retry: a request answered 503 before any of its work started (the engine of this replica failed: its queued jobs
  end 503 unstarted, and a request reaching it meanwhile gets 503 before queueing) is sent once to another replica
  (``retry``: through a deployment handle that excludes this one, `deploy.router`). Its answer carries
  ``X-Xstage-Retried: <this replica>: <the 503's message>``; when no other replica is ready within the wait, the
  503 stands, with ``X-Xstage-Retry-Failed``. A request whose job started (it was running on the failed engine)
  keeps its 503: nothing runs twice. A retried request is never retried again.
- ``/health``: 200 when at least one replica is ready (this one, or another per the directory), with this
  replica's own state under ``replica_status`` and every replica's under ``replicas``; 503 when none is.
- ``/metrics``: every live replica's metrics, labelled ``replica`` (`deploy.metrics`).
- Every answer names the replica that made it: ``X-Xstage-Replica``. A request's answer also waits for the
  directory writes it caused (a new video job's registration, a delete), so the next request sees them wherever it
  lands.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, AsyncIterator, Awaitable, Callable

from xstage_dit.deploy.jobs import close_scope, open_scope
from xstage_dit.deploy.metrics import merge
from xstage_dit.deploy.mirror import SETTLE_S, Mirror
from xstage_dit.server.metrics import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)

REPLICA_HEADER = b"x-xstage-replica"
RETRIED_HEADER = b"x-xstage-retried"
RETRY_FAILED_HEADER = b"x-xstage-retry-failed"
RETRY_MARK = b"x-xstage-retry-of"  # on a request sent again: never retried a second time
JOB_PATH = re.compile(r"^/v1/(?:videos|jobs)/(?P<id>[^/]+)(?P<rest>/content|/events)?$")
METRICS_WAIT_S = 2.0
MAX_RETRY_BODY_BYTES = 80 << 20  # past the largest upload the server takes (64 MiB): such a 503 is not retried

Retry = Callable[[dict], Awaitable[AsyncIterator[dict]]]


def _header(value: str) -> bytes:
    """A header value from any text: one line of latin-1, at most 300 characters."""
    line = " ".join(str(value).split())[:300]
    return line.encode("latin-1", "replace")


def with_header(message: dict, name: bytes, value: str) -> dict:
    return {**message, "headers": [*message.get("headers", []), (name, _header(value))]}


def request_scope(path: str, method: str = "GET") -> dict:
    """An ASGI scope of an internal request (the app's own ``/health`` or ``/metrics``)."""
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": [],
            "client": None, "server": None}


async def capture(app: Any, scope: dict) -> tuple[int, list, bytes]:
    """(status, headers, body) of `app`'s answer to `scope` with an empty body."""
    messages: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        messages.append(message)

    await app(scope, receive, send)
    start = next(m for m in messages if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    return start["status"], start.get("headers", []), body


class ReplicaIngress:
    """The ASGI app a replica serves (module docstring). app: `create_app(worker)`; replica_id: this replica's
    Serve id; mirror: its `Mirror`; retry: ``await retry(request)`` gives the messages of `request` (a dict of
    method, path, query_string, headers, body) answered by another replica, None to never retry; retry_wait_s:
    how long the first of them may take."""

    def __init__(self, app: Any, replica_id: str, mirror: Mirror, retry: Retry | None = None,
                 retry_wait_s: float = 60.0):
        self.app, self.replica_id, self.mirror = app, replica_id, mirror
        self.retry, self.retry_wait_s = retry, retry_wait_s

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)  # lifespan
        path, method = scope["path"], scope["method"]
        if path == "/health" and method == "GET":
            return await self._health(scope, send)
        if path == "/metrics" and method == "GET":
            return await self._metrics(scope, send)
        await self._resolve(path, method)
        retry = self.retry is not None and all(name != RETRY_MARK for name, _ in scope.get("headers", []))
        state, token = open_scope()
        body: list[dict] = []
        held: list[dict] = []  # the answer while it may still be replaced by a retry
        decided: list[str] = []

        async def recording_receive() -> dict:
            message = await receive()
            if message["type"] == "http.request" and retry:
                body.append(message)
            return message

        async def guarded_send(message: dict) -> None:
            if isinstance(message.get("body"), memoryview):  # the server's spliced JSON: Serve pickles messages
                message = {**message, "body": bytes(message["body"])}
            if not decided and message["type"] == "http.response.start":
                if retry and message["status"] == 503 and state.never_started():
                    decided.append("retry")
                else:
                    decided.append("answer")
                    await state.settle(SETTLE_S)
                    message = with_header(message, REPLICA_HEADER, self.replica_id)
            if decided and decided[0] == "retry":
                held.append(message)
            else:
                await send(message)

        try:
            await self.app(scope, recording_receive, guarded_send)
        finally:
            close_scope(token)
        if decided and decided[0] == "retry":
            await self._retry(scope, receive, body, held, send)

    async def _resolve(self, path: str, method: str) -> None:
        try:
            match = JOB_PATH.match(path)
            if match is not None:
                await self.mirror.resolve(match["id"], content=match["rest"] == "/content")
            elif path == "/v1/videos" and method == "GET":
                await self.mirror.sync("video")
        except Exception:  # noqa: BLE001 - answered from this replica's own jobs alone (404 for another's)
            log.exception("job directory lookup for %s %s failed", method, path)

    async def _retry(self, scope: dict, receive: Callable, body: list[dict], held: list[dict], send: Callable) -> None:
        """Send the request again to another replica (see the module docstring); the held 503 when none answers."""
        data = await _whole_body(receive, body)
        if data is None:
            return await self._stand(held, send, "the request's body could not be kept to send again")
        reason = _message_of(held)
        request = {"method": scope["method"], "path": scope["path"], "query_string": scope.get("query_string", b""),
                   "headers": [*scope.get("headers", []), (RETRY_MARK, self.replica_id.encode())], "body": data}
        messages = None
        try:
            messages = await self.retry(request)
            first = await asyncio.wait_for(messages.__anext__(), self.retry_wait_s)
        except Exception as exc:  # noqa: BLE001 - no replica took it (in time): the 503 stands, saying so
            why = "no other replica ready" if isinstance(exc, asyncio.TimeoutError) else f"{type(exc).__name__}: {exc}"
            log.warning("retry of %s %s failed: %s", scope["method"], scope["path"], why)
            if messages is not None and hasattr(messages, "cancel"):
                messages.cancel()
            return await self._stand(held, send, f"{why} within {self.retry_wait_s:g} s")
        log.info("%s %s answered 503 here before it started (%s): retried on another replica", scope["method"],
                 scope["path"], reason)
        await send(with_header(first, RETRIED_HEADER, f"{self.replica_id}: {reason}"))
        async for message in messages:
            await send(message)

    async def _stand(self, held: list[dict], send: Callable, why: str) -> None:
        """Send the held 503 after all, saying why it was not retried."""
        held[0] = with_header(with_header(held[0], REPLICA_HEADER, self.replica_id), RETRY_FAILED_HEADER, why)
        for message in held:
            await send(message)

    async def _health(self, scope: dict, send: Callable) -> None:
        status, _, body = await capture(self.app, scope)
        local = json.loads(body)
        try:
            replicas = await self.mirror.directory.call("replicas")
        except Exception as exc:  # noqa: BLE001 - this replica's own state alone
            log.warning("job directory unreachable for /health: %s", exc)
            replicas = {}
        replicas[self.replica_id] = {**replicas.get(self.replica_id, {}), "state": local["status"],
                                     "reason": local.get("reason"), "age_s": 0.0}
        ready = sum(1 for r in replicas.values() if r.get("state") == "ready")
        out = {**local, "status": "ready" if ready else local["status"], "replica": self.replica_id,
               "replica_status": local["status"], "ready_replicas": ready, "replicas": replicas}
        await _send_json(send, 200 if ready else 503, out, self.replica_id)

    async def _metrics(self, scope: dict, send: Callable) -> None:
        texts = {self.replica_id: (await capture(self.app, scope))[2].decode()}
        try:
            texts.update(await self.mirror.directory.call("gather_metrics", self.replica_id, METRICS_WAIT_S))
        except Exception as exc:  # noqa: BLE001 - this replica's own metrics alone
            log.warning("job directory unreachable for /metrics: %s", exc)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode()), (REPLICA_HEADER,
                                                                                 _header(self.replica_id))]})
        await send({"type": "http.response.body", "body": merge(texts)})

    async def local_metrics(self) -> str:
        """This replica's Prometheus text (what another replica's ``/metrics`` asks for)."""
        return (await capture(self.app, request_scope("/metrics")))[2].decode()


async def _whole_body(receive: Callable, body: list[dict]) -> bytes | None:
    """The request's body: what the app read (`body`, its messages) and the rest, which the app may have left
    unread when it answered; None past `MAX_RETRY_BODY_BYTES` or when the client left."""
    size = sum(len(m.get("body", b"")) for m in body)
    while body and body[-1].get("more_body", False) and size <= MAX_RETRY_BODY_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return None
        body.append(message)
        size += len(message.get("body", b""))
    if size > MAX_RETRY_BODY_BYTES:
        return None
    return b"".join(m.get("body", b"") for m in body)


def _message_of(held: list[dict]) -> str:
    """The error message of a held JSON error answer (the server's one error shape)."""
    try:
        payload = b"".join(m.get("body", b"") for m in held if m["type"] == "http.response.body")
        return json.loads(payload)["error"]["message"]
    except Exception:  # noqa: BLE001 - not the error shape: say what it was
        return "503"


async def _send_json(send: Callable, status: int, payload: dict, replica_id: str) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (REPLICA_HEADER, _header(replica_id))]})
    await send({"type": "http.response.body", "body": body})
