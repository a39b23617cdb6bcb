"""`GET /health` (200 only when every rank is ready) and `GET /metrics` (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from xstage_dit.server.deps import worker_of
from xstage_dit.server.metrics import CONTENT_TYPE_LATEST
from xstage_dit.server.worker import READY, Worker

router = APIRouter()


@router.get("/health", summary="Server state: 200 when every rank is ready, 503 (with the reason) otherwise",
            responses={503: {"description": "Not ready: the same body, with the state and its reason"}})
async def health(worker: Worker = Depends(worker_of)):
    body = {"status": worker.state, "world_size": worker.ctx.world_size if worker.ctx else None,
            "model": worker.served.name if worker.served else None, "reason": worker.reason,
            "queue_depth": worker.queue.depth, "running": worker.queue.running,
            "ranks": [worker.ranks[r] for r in sorted(worker.ranks)]}
    return JSONResponse(body, status_code=200 if worker.state == READY else 503)


@router.get("/metrics", summary="Prometheus metrics")
async def prometheus(worker: Worker = Depends(worker_of)):
    worker.metrics.queue_depth.set(worker.queue.depth)
    worker.metrics.running_jobs.set(worker.queue.running)
    return Response(worker.metrics.render(), media_type=CONTENT_TYPE_LATEST)
