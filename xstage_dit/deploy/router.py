"""The request router of the engine deployment (Ray Serve's ``request_router_config``): Serve's power of two
choices, over the replicas whose engine is ready, never over the replica a retry comes from.

Each replica reports ``{"ready": bool}`` as its routing stats (``record_routing_stats``, every
``request_routing_stats_period_s``): a replica whose rank died answers 503 until Serve's health check replaces it,
and for that while the router sends new requests elsewhere. A retry of a request that never started
(`deploy.ingress`) is made through a deployment handle with ``exclude=<the failed replica's id>``: that replica is
never chosen for it, even before its routing stats say it failed.

When no replica is ready, a request from the HTTP proxy still goes to one of them (it answers 503 at once and says
why), while a retry waits (the router backs off) until a ready replica other than the excluded one exists, a
replacement included; the retrying replica bounds that wait (`DeployOptions.retry_wait_s`).
"""

from __future__ import annotations

import random
from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

#: The keyword of a retry's handle call naming the replica it must not go to.
EXCLUDE = "exclude"


def ready_candidates(candidates: list, exclude: str | None) -> list:
    """The replicas to choose from: the ready ones but `exclude`; with none ready and no exclusion (a request from
    the proxy), all of them (they answer 503 at once, saying why)."""
    allowed = [r for r in candidates if r.replica_id.unique_id != exclude]
    ready = [r for r in allowed if (r.routing_stats or {}).get("ready", True)]
    return ready if ready or exclude is not None else allowed


class ReadyReplicaRouter(RequestRouter):
    """Power of two choices over `ready_candidates` (module docstring). The chosen pair goes back to Serve, which
    sends the request to the one with the shorter queue. Requests are matched to replicas one by one (no FIFO
    mixin: a retry's exclusion must hold for that retry)."""

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        kwargs = (pending_request.kwargs or {}) if pending_request is not None else {}
        candidates = ready_candidates(list(candidate_replicas), kwargs.get(EXCLUDE))
        if not candidates:
            return []  # back off: a ready replica (a replacement) may come
        return [random.sample(candidates, min(2, len(candidates)))]
