"""`POST /v1/images/generations`, the handler: queue the job, then answer synchronously (the client waits;
leaving cancels the job), as server-sent events, or as the one PNG; and the answer's JSON, written once."""

from __future__ import annotations

import asyncio
import base64
import json
import time

from fastapi import Request
from fastapi.responses import Response

from xstage_dit.server import b64_json
from xstage_dit.server.config import ServerConfig
from xstage_dit.server.deps import enqueue, failure, new_job, served
from xstage_dit.server.http_layer import error_response
from xstage_dit.server.image_input import check_text_only
from xstage_dit.server.images.protocol import (ImageData, ImageGenerationRequest, ImageGenerationResponse,
                                               ImageJobSpec, image_params)
from xstage_dit.server.images.stream import GENERATION, background_of, openai_stream
from xstage_dit.server.job_queue import COMPLETED, Job
from xstage_dit.server.protocol import Timings
from xstage_dit.server.sse import sse_response
from xstage_dit.server.worker import Worker

DISCONNECT_POLL_S = 0.25


def _image_response(worker: Worker, job: Job, spec: ImageJobSpec, b64: list[str]) -> ImageGenerationResponse:
    """A completed image job's answer with `b64[i]` as image i's b64_json (images paired with their items)."""
    return ImageGenerationResponse(
        created=int(job.created), model=worker.served.name, job_id=job.id, batch_size=job.batch_size,
        data=[ImageData(b64_json=text, seed=item.seed) for text, item in zip(b64, job.items)],
        timings=Timings(**job.timings()), background=background_of(job.results[0]),
        output_format=spec.encoding.format, quality=spec.quality, size=spec.size,
        usage=spec.usage(worker.served.size_multiple), safety_identifier=spec.safety_identifier)


def image_payload(worker: Worker, job: Job, spec: ImageJobSpec) -> dict:
    """The JSON answer of a completed image job as a dict: one base64 image and seed per image. The reference
    `image_json` (what the endpoint sends) is tested against."""
    return _image_response(worker, job, spec, [base64.b64encode(png).decode() for png in job.results]).model_dump()


def image_json(worker: Worker, job: Job, spec: ImageJobSpec) -> memoryview:
    """`image_payload` as the JSON body, written once (`b64_json.splice`: pydantic renders the small fields around a
    placeholder per image, each image's base64 goes straight into the one output buffer);
    tests/server/test_server_api.py holds the equality with `image_payload`."""
    token = b64_json.new_token()
    blobs = [png for png, _ in zip(job.results, job.items)]  # the pairs `_image_response` made placeholders of
    shell = _image_response(worker, job, spec, [b64_json.placeholder(token, i) for i in range(len(blobs))])
    return b64_json.splice(shell.model_dump_json().encode(), token, blobs)


def png_response(job: Job) -> Response:
    """A completed one-image job as its PNG body; seed, job id, batch size and timings (JSON) in headers."""
    return Response(job.results[0], media_type="image/png", headers={
        "X-Job-Id": job.id, "X-Seed": str(job.items[0].seed), "X-Batch-Size": str(job.batch_size),
        "X-Timings": json.dumps(Timings(**job.timings()).model_dump(), separators=(",", ":"))})


async def generate(req: ImageGenerationRequest, request: Request, worker: Worker, config: ServerConfig) -> Response:
    """Queue the images of `req` as one job and answer it: JSON (`image_json`), the PNG itself
    (`response_format: png`) or OpenAI's server-sent events (`stream: true`, `images.stream`). A client that
    leaves before the end cancels its job (499)."""
    check_text_only(served(worker))  # a model that needs input images answers at /v1/images/edits
    return await answer(image_params(req, served(worker), config), req, request, worker, config)


async def answer(spec: ImageJobSpec, req: ImageGenerationRequest, request: Request, worker: Worker,
                 config: ServerConfig, prefix: str = GENERATION) -> Response:
    """Queue the checked job `spec` and answer it as `req` asks (JSON, PNG or a stream whose OpenAI events are
    ``<prefix>.*``): what ``/v1/images/generations`` and ``/v1/images/edits`` share."""
    job = new_job(config, spec.items)
    job.encoding, job.partial_images = spec.encoding, spec.partial_images
    # Subscribed before it is queued: a fast first step must not run before the client listens (a stream on a
    # loaded 2-core CI machine began at step 3 of 4).
    q = job.subscribe(progress=bool(req.stream))  # an answer in one piece waits for the end alone
    enqueue(worker, job)
    if req.stream:
        return sse_response(openai_stream(worker, job, spec, q, prefix), job)
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
    return Response(image_json(worker, job, spec), media_type="application/json", headers={"X-Job-Id": job.id})
