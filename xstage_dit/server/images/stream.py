"""The stream of `POST /v1/images/generations` with ``stream: true``: OpenAI's image events, as the SDK's
``ImageGenStreamEvent`` types expect them, and our per-step progress where the SDK does not look.

    : xstage.progress {"job_id":...,"status":"in_progress","steps_done":1,"steps_total":4}
    event: image_generation.partial_image
    data: {"type":"image_generation.partial_image","partial_image_index":0,"b64_json":"...","size":"64x64",...}
    event: image_generation.completed
    data: {"type":"image_generation.completed","b64_json":"...","usage":{...},"seed":7,"image_index":0,...}

- ``image_generation.partial_image``: the previews a request asked for (``partial_images``, `server.previews`),
  ``partial_image_index`` 0.. per image; ``image_index`` (ours) says which image of ``n``.
- ``image_generation.completed``: one per image, in order, with OpenAI's fields (``b64_json``, ``background``,
  ``created_at``, ``output_format``, ``quality``, ``size``, ``usage``) and ours (``job_id``, ``seed``,
  ``image_index``, ``timings``).
- progress: an SSE comment line (``: xstage.progress {json}``) after every step. The SDK hands every event that
  carries data to its caller as an image event, so a progress *event* would reach SDK users as an event without
  ``type`` or ``b64_json``; a comment line is skipped by every SSE client (the standard says so), and read by ours
  (the web page). Per-step progress as named events: ``GET /v1/jobs/{id}/events``.
- ``error``: a job that fails or times out; the SDK raises it as an ``APIError``.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from typing import AsyncIterator

from xstage_dit.server import b64_json
from xstage_dit.server.images.protocol import ImageJobSpec
from xstage_dit.server.job_queue import COMPLETED, TERMINAL, Job
from xstage_dit.server.protocol import Timings
from xstage_dit.server.sse import KEEPALIVE, comment, error_event, follow
from xstage_dit.server.worker import Worker

PROGRESS = "xstage.progress"
#: the events' prefix: "image_generation" here, "image_edit" for /v1/images/edits (OpenAI's edit stream)
GENERATION = "image_generation"


def background_of(data: bytes) -> str | None:
    """'transparent' when the encoded image keeps an alpha channel, else 'opaque' (reads the header only); None for
    bytes that are no image Pillow knows."""
    from PIL import Image, UnidentifiedImageError

    try:
        mode = Image.open(io.BytesIO(data)).mode
    except UnidentifiedImageError:
        return None
    return "transparent" if mode in ("RGBA", "LA", "PA") else "opaque"


def _event(name: str, payload: dict, data: bytes) -> memoryview:
    """``event: name`` with `payload` plus ``b64_json`` = base64 of `data`, written once (`b64_json.splice`)."""
    token = b64_json.new_token()
    shell = json.dumps({"type": name, "b64_json": b64_json.placeholder(token, 0), **payload},
                       separators=(",", ":")).encode()
    return b64_json.splice(b"event: " + name.encode() + b"\ndata: " + shell + b"\n\n", token, [data])


def _common(spec: ImageJobSpec, data: bytes) -> dict:
    return {"background": background_of(data) or "auto", "created_at": int(time.time()), "output_format": spec.encoding.format,
            "quality": spec.quality or "auto", "size": spec.size}


def partial_event(spec: ImageJobSpec, job: Job, preview: dict, prefix: str = GENERATION) -> memoryview:
    """The ``<prefix>.partial_image`` event of one preview (`previews.PreviewPlan` publishes them)."""
    return _event(f"{prefix}.partial_image", {**_common(spec, preview["data"]), "partial_image_index": preview["partial_image_index"],
                            "job_id": job.id, "image_index": preview["image_index"]}, preview["data"])


def completed_events(spec: ImageJobSpec, job: Job, size_multiple: int, prefix: str = GENERATION) -> list[memoryview]:
    """One ``<prefix>.completed`` event per image of a completed job, in order."""
    usage = spec.usage(size_multiple).model_dump()
    timings = Timings(**job.timings()).model_dump()
    extra = {"safety_identifier": spec.safety_identifier} if spec.safety_identifier else {}
    return [_event(f"{prefix}.completed", {**_common(spec, data), "usage": usage, **extra, "job_id": job.id,
                                     "seed": item.seed, "image_index": i, "timings": timings}, data)
            for i, (data, item) in enumerate(zip(job.results, job.items))]


async def openai_stream(worker: Worker, job: Job, spec: ImageJobSpec, q: asyncio.Queue,
                        prefix: str = GENERATION) -> AsyncIterator[bytes | memoryview]:
    """The stream of a queued image job (subscribed as `q` before it was queued); a client that leaves cancels it.
    prefix: the OpenAI event family ("image_generation", or "image_edit" for an edit)."""
    async for event in follow(worker, job, cancel_on_disconnect=True, q=q):
        if event is None:
            yield KEEPALIVE
        elif "partial_image" in event:
            yield partial_event(spec, job, event["partial_image"], prefix)
        elif event["status"] not in TERMINAL or event["status"] == COMPLETED:
            yield comment(PROGRESS, event)
            if event["status"] == COMPLETED:
                for chunk in completed_events(spec, job, worker.served.size_multiple, prefix):
                    yield chunk
        else:
            yield error_event(job)
