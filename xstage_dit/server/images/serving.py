"""`POST /v1/images/generations`, the handler: queue the job, then answer synchronously (the client waits;
leaving cancels the job), as server-sent events, or as the one PNG; and the answer's JSON, written once."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import secrets
import time

from fastapi import Request
from fastapi.responses import Response

from xstage_dit.server.config import ServerConfig
from xstage_dit.server.deps import enqueue, failure, new_job, served
from xstage_dit.server.http_layer import error_response
from xstage_dit.server.image_input import check_text_only
from xstage_dit.server.images.protocol import ImageData, ImageGenerationRequest, ImageGenerationResponse, image_params
from xstage_dit.server.job_queue import COMPLETED, Job
from xstage_dit.server.protocol import Timings
from xstage_dit.server.sse import events, sse_response
from xstage_dit.server.worker import Worker

DISCONNECT_POLL_S = 0.25


def _image_response(worker: Worker, job: Job, b64: list[str]) -> ImageGenerationResponse:
    """A completed image job's answer with `b64[i]` as image i's b64_json (images paired with their items)."""
    return ImageGenerationResponse(
        created=int(job.created), model=worker.served.name, job_id=job.id, batch_size=job.batch_size,
        data=[ImageData(b64_json=text, seed=item.seed) for text, item in zip(b64, job.items)],
        timings=Timings(**job.timings()))


def image_payload(worker: Worker, job: Job) -> dict:
    """The JSON answer of a completed image job as a dict: one base64 PNG and seed per image. The reference
    `image_json` (what the endpoint sends) is tested against."""
    return _image_response(worker, job, [base64.b64encode(png).decode() for png in job.results]).model_dump()


_B64_CHUNK = 3 * 16384  # PNG bytes per base64 call (a multiple of 3: no padding inside): 64 KB out, a heap block


def image_json(worker: Worker, job: Job) -> memoryview:
    """`image_payload` as the JSON body, written once. pydantic renders the small fields around a placeholder
    per image; each PNG's base64 goes straight into the one output buffer, in chunks (base64's alphabet needs
    no JSON escaping). Why: through ``JSONResponse`` the answer's base64 was copied five times (encode, decode
    to str, the dump, its encoding), each multi-megabyte copy mapped afresh by malloc, on the HTTP thread
    (the times and page faults of both ways: benchmarks/results/serving/NOTES.md);
    tests/server/test_server_api.py holds the equality with `image_payload`."""
    token = secrets.token_hex(8)
    shell = _image_response(worker, job, [f"{token}-{i}" for i in range(len(job.results))]).model_dump_json().encode()
    pieces, rest = [], shell
    for i, (png, _) in enumerate(zip(job.results, job.items)):  # the pairs `_image_response` made placeholders of
        before, rest = rest.split(f'"{token}-{i}"'.encode(), 1)
        pieces.append((before, png))
    out = bytearray(sum(len(before) + 2 + 4 * -(-len(png) // 3) for before, png in pieces) + len(rest))
    at = 0
    for before, png in pieces:
        for part in (before, b'"', *(binascii.b2a_base64(memoryview(png)[i:i + _B64_CHUNK], newline=False)
                                      for i in range(0, len(png), _B64_CHUNK)), b'"'):
            out[at:at + len(part)] = part
            at += len(part)
    out[at:] = rest
    return memoryview(out)


def png_response(job: Job) -> Response:
    """A completed one-image job as its PNG body; seed, job id, batch size and timings (JSON) in headers."""
    return Response(job.results[0], media_type="image/png", headers={
        "X-Job-Id": job.id, "X-Seed": str(job.items[0].seed), "X-Batch-Size": str(job.batch_size),
        "X-Timings": json.dumps(Timings(**job.timings()).model_dump(), separators=(",", ":"))})


async def generate(req: ImageGenerationRequest, request: Request, worker: Worker, config: ServerConfig) -> Response:
    """Queue the images of `req` as one job and answer it: JSON (`image_json`), the PNG itself
    (`response_format: png`) or server-sent events (`stream: true`). A client that leaves before the end
    cancels its job (499)."""
    check_text_only(served(worker))  # a model that needs input images answers at /v1/images/edits
    job = new_job(config, image_params(req, served(worker), config))
    # Subscribed before it is queued: a fast first step must not run before the client listens (a stream on a
    # loaded 2-core CI machine began at step 3 of 4).
    q = job.subscribe(progress=req.stream)  # an answer in one piece waits for the end alone
    enqueue(worker, job)
    if req.stream:
        return sse_response(events(worker, job, lambda j: image_json(worker, j), cancel_on_disconnect=True, q=q),
                            job)
    try:
        next_check = time.monotonic() + DISCONNECT_POLL_S
        while not job.done:
            try:
                await asyncio.wait_for(q.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                pass
            if time.monotonic() >= next_check:  # on a clock: progress events may come faster
                next_check = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    worker.queue.cancel(job.id)  # the client went away: free its place
                    worker.metrics.errors.labels("client_disconnected").inc()
                    return error_response(499, "client disconnected")
    finally:
        job.unsubscribe(q)
    if job.status != COMPLETED:
        return failure(job)
    if req.response_format == "png":
        return png_response(job)
    return Response(image_json(worker, job), media_type="application/json", headers={"X-Job-Id": job.id})
