"""`ReplicaIngress` around a stand-in app, without Ray: which 503 answers are sent again to another replica (none of
the request's work started) and how the answer says so, the 503 that stands when no replica takes it, and
``/health`` meaning "at least one replica ready"."""

from __future__ import annotations

import asyncio
import json
import time

from xstage_dit.deploy.directory import JobDirectory
from xstage_dit.deploy.ingress import (REPLICA_HEADER, RETRIED_HEADER, RETRY_FAILED_HEADER, RETRY_MARK,
                                       ReplicaIngress, request_scope)
from xstage_dit.deploy.jobs import MirroredQueue
from xstage_dit.deploy.mirror import DirectoryClient, Mirror
from xstage_dit.runtime.generation import GenerationRequest
from xstage_dit.server.job_queue import Job


def error_503(message: str) -> list[dict]:
    body = json.dumps({"error": {"message": message, "type": "service_unavailable", "param": None,
                                 "code": 503}}).encode()
    return [{"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"application/json")]},
            {"type": "http.response.body", "body": body}]


class StandIn:
    """An app that reads the body (only `read_bytes` of it), may submit a job (started or not), then answers."""

    def __init__(self, queue: MirroredQueue, answer: list[dict], submit: bool = True, started: bool = False,
                 read_bytes: int | None = None):
        self.queue, self.answer, self.submit, self.started, self.read_bytes = queue, answer, submit, started, read_bytes
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body") or (self.read_bytes is not None and len(body) >= self.read_bytes):
                break
        self.bodies.append(body)
        if self.submit:
            item = GenerationRequest(kind="image", prompt="p", width=16, height=16, steps=1, guidance=1.0)
            job = self.queue.submit(Job(id=f"img_{len(self.bodies)}", items=[item], deadline=time.time() + 60))
            if self.started:
                job.started = time.time()
        for message in self.answer:
            await send(message)


def make(answer: list[dict], retry=None, **stand_in) -> tuple[ReplicaIngress, StandIn, JobDirectory]:
    directory = JobDirectory()
    queue = MirroredQueue(max_queue=8, max_batch_size=1)
    mirror = Mirror("a", queue, DirectoryClient(lambda: directory, local=True), lambda: {}, lambda: None)
    app = StandIn(queue, answer, **stand_in)
    return ReplicaIngress(app, "a", mirror, retry, retry_wait_s=0.5), app, directory


async def call(ingress: ReplicaIngress, body: bytes = b"{}", headers=(), chunks: int = 1) -> list[dict]:
    scope = {**request_scope("/v1/images/generations", "POST"), "headers": list(headers)}
    size = -(-len(body) // chunks)
    parts = [body[i:i + size] for i in range(0, len(body), size)] or [b""]
    incoming = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    sent: list[dict] = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await ingress(scope, receive, send)
    return sent


def header(messages: list[dict], name: bytes) -> str | None:
    start = next(m for m in messages if m["type"] == "http.response.start")
    return next((v.decode() for k, v in start["headers"] if k == name), None)


class Elsewhere:
    """A retry target: records the request, answers 200 from replica "b"."""

    def __init__(self):
        self.requests: list[dict] = []

    async def __call__(self, request: dict):
        self.requests.append(request)

        async def messages():
            yield {"type": "http.response.start", "status": 200, "headers": [(REPLICA_HEADER, b"b")]}
            yield {"type": "http.response.body", "body": b"image"}

        return messages()


def test_a_503_before_anything_started_is_answered_by_another_replica_and_says_so():
    async def scenario():
        retry = Elsewhere()
        ingress, app, _ = make(error_503("server unavailable: lost a rank: rank 1 died"), retry, read_bytes=4)
        sent = await call(ingress, body=b"0123456789", chunks=5)  # the app stopped reading after 4 bytes
        assert sent[0]["status"] == 200 and sent[-1]["body"] == b"image"
        assert header(sent, RETRIED_HEADER) == "a: server unavailable: lost a rank: rank 1 died"
        assert header(sent, REPLICA_HEADER) == "b"
        request = retry.requests[0]
        assert request["body"] == b"0123456789" and (RETRY_MARK, b"a") in request["headers"]

    asyncio.run(scenario())


def test_a_503_of_a_started_job_or_of_a_retried_request_stands():
    async def scenario():
        retry = Elsewhere()
        ingress, _, _ = make(error_503("server unavailable: rank 1 died"), retry, started=True)
        sent = await call(ingress)
        assert sent[0]["status"] == 503 and header(sent, REPLICA_HEADER) == "a" and not retry.requests
        ingress, _, _ = make(error_503("server unavailable"), retry)
        sent = await call(ingress, headers=[(RETRY_MARK, b"z")])  # already sent once: never twice
        assert sent[0]["status"] == 503 and not retry.requests
        ingress, _, _ = make(error_503("no retry configured"), None)
        assert (await call(ingress))[0]["status"] == 503
        ok = [{"type": "http.response.start", "status": 200, "headers": []},
              {"type": "http.response.body", "body": memoryview(b"spliced json")}]
        ingress, _, _ = make(ok, retry)
        sent = await call(ingress)
        assert sent[0]["status"] == 200 and header(sent, REPLICA_HEADER) == "a"
        assert sent[1]["body"] == b"spliced json" and isinstance(sent[1]["body"], bytes)  # Serve pickles it

    asyncio.run(scenario())


def test_the_503_stands_when_no_other_replica_takes_the_retry():
    async def nowhere(request: dict):
        async def messages():
            await asyncio.sleep(10)  # the router waits for a ready replica that never comes
            yield {}

        return messages()

    async def scenario():
        ingress, _, _ = make(error_503("server unavailable: rank 1 died"), nowhere, submit=False)
        sent = await call(ingress)
        assert sent[0]["status"] == 503 and "rank 1 died" in json.loads(sent[1]["body"])["error"]["message"]
        assert header(sent, RETRY_FAILED_HEADER) == "no other replica ready within 0.5 s"

    asyncio.run(scenario())


def test_health_is_200_while_any_replica_is_ready():
    async def scenario():
        local = {"status": "failed", "reason": "rank 1 died", "world_size": 2}
        body = json.dumps(local).encode()
        failed = [{"type": "http.response.start", "status": 503, "headers": []},
                  {"type": "http.response.body", "body": body}]
        ingress, _, directory = make(failed)
        sent = []

        async def send(message):
            sent.append(message)

        await ingress(request_scope("/health"), None, send)
        assert sent[0]["status"] == 503 and json.loads(sent[1]["body"])["ready_replicas"] == 0
        await directory.report("b", {"state": "ready", "reason": None})
        sent.clear()
        await ingress(request_scope("/health"), None, send)
        health = json.loads(sent[1]["body"])
        assert sent[0]["status"] == 200 and health["status"] == "ready" and health["replica_status"] == "failed"
        assert health["ready_replicas"] == 1 and set(health["replicas"]) == {"a", "b"} and health["replica"] == "a"

    asyncio.run(scenario())


def test_a_503_whose_body_cannot_be_read_again_stands():
    async def scenario():
        retry = Elsewhere()
        ingress, _, _ = make(error_503("server unavailable"), retry, read_bytes=2)
        scope = request_scope("/v1/images/generations", "POST")
        incoming = [{"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.disconnect"}]
        sent: list[dict] = []

        async def receive():
            return incoming.pop(0)

        async def send(message):
            sent.append(message)

        await ingress(scope, receive, send)  # the client left before its body was all sent
        assert sent[0]["status"] == 503 and not retry.requests
        assert header(sent, RETRY_FAILED_HEADER) == "the request's body could not be kept to send again"

    asyncio.run(scenario())
