"""The Ray Serve application: `build` turns `DeployOptions` into it (the engine deployment, its placement groups,
health checks, router, autoscaling and job directory), `app` is the builder ``serve run`` calls, and `run` is what
``xstage-dit serve --replicas N`` does (connect to or start a Ray cluster, run the application, serve until
interrupted).

Examples::

    serve run xstage_dit.deploy:app model=tiny-flux sp=2 replicas=2 gpus_per_rank=0
    xstage-dit serve --model tiny-flux --sp 2 --replicas 2               # a local Ray cluster
    xstage-dit serve --model full-flux --sp 4 --min-replicas 1 --max-replicas 4 --ray-address auto
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import threading
from typing import Any

from xstage_dit.deploy.directory import JobDirectory
from xstage_dit.deploy.options import DeployOptions

log = logging.getLogger(__name__)

DEPLOYMENT = "engine"
ROUTER = "xstage_dit.deploy.router:ReadyReplicaRouter"


def deployment_options(options: DeployOptions) -> dict[str, Any]:
    """The keyword arguments of ``serve.deployment`` for `options` (besides the deployment-scoped actor)."""
    scaling = ({"autoscaling_config": options.autoscaling.serve_config()} if options.autoscaling is not None
               else {"num_replicas": options.replicas})
    return {
        "name": DEPLOYMENT,
        # the replica actor is rank 0: it takes bundle 0 of its placement group, the ranks 1.. the others
        "ray_actor_options": {"num_cpus": options.cpus_per_rank, "num_gpus": options.gpus_per_rank},
        "placement_group_bundles": [options.bundle() for _ in range(options.world_size)],
        "placement_group_strategy": "STRICT_PACK",
        "max_ongoing_requests": options.max_ongoing_requests,
        "health_check_period_s": options.health_check_period_s,
        "health_check_timeout_s": options.health_check_timeout_s,
        "graceful_shutdown_timeout_s": options.graceful_s,
        "max_constructor_retry_count": 3,  # a model that fails to load fails again: say so, do not loop
        **scaling,
    }


def build(options: DeployOptions):
    """The Serve application (``serve.run(build(options), route_prefix="/")``)."""
    import ray
    from ray import serve
    from ray.serve.config import DeploymentActorConfig, RequestRouterConfig

    from xstage_dit.deploy.replica import DIRECTORY, EngineReplica

    directory = DeploymentActorConfig(
        name=DIRECTORY, actor_class=ray.remote(JobDirectory), actor_options={"num_cpus": 0},
        init_kwargs={"job_ttl_s": options.server.job_ttl_s, "max_stored_jobs": options.server.max_stored_jobs})
    router = RequestRouterConfig(request_router_class=ROUTER,
                                 request_routing_stats_period_s=options.routing_stats_period_s)
    deployment = serve.deployment(EngineReplica, request_router_config=router, deployment_actors=[directory],
                                  **deployment_options(options))
    # The replicas' own options leave the replica count out: changing it (or the autoscaling bounds) is then a
    # lightweight update of the running deployment (replicas added, or removed after draining), not a restart.
    return deployment.bind(dataclasses.replace(options, replicas=1, autoscaling=None))


def app(args: dict[str, Any]):
    """The application builder of ``serve run xstage_dit.deploy:app key=value ...`` (`DeployOptions.from_args`)."""
    return build(DeployOptions.from_args(args))


def run(options: DeployOptions, *, ray_address: str | None = None, host: str = "127.0.0.1", port: int = 8000,
        gpus_per_rank: float | None = None, stop: threading.Event | None = None) -> int:
    """Serve `options` on Ray until SIGINT / SIGTERM (or `stop`), then delete the application; returns an exit code.

    ray_address: an existing cluster ("auto", "ray://host:10001", "host:6379"); None starts one on this machine.
    gpus_per_rank: None takes one GPU a rank when the cluster has GPUs, none otherwise.
    """
    import ray
    from ray import serve

    ray.init(address=ray_address, log_to_driver=True)
    stop = stop or threading.Event()
    starting = _on_stop_signals(stop)  # after ray.init, which sets a SIGTERM handler of its own
    try:
        if gpus_per_rank is None:
            gpus_per_rank = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
        options = dataclasses.replace(options, gpus_per_rank=gpus_per_rank)
        try:
            serve.start(http_options={"host": host, "port": port})
            serve.run(build(options), name=options.app_name, route_prefix="/")
        except _Stopped:
            log.warning("stopped while the replicas were starting")
        else:
            starting.clear()
            _announce(options, host, port)
            while not stop.wait(0.5):
                pass
        serve.delete(options.app_name)
        return 0
    finally:
        ray.shutdown()


class _Stopped(Exception):
    """SIGINT / SIGTERM while the application starts (loading can take minutes)."""


def _on_stop_signals(stop: threading.Event) -> threading.Event:
    """SIGINT / SIGTERM set `stop`; while the returned event is set (start-up) they also interrupt it."""
    starting = threading.Event()
    starting.set()

    def handler(signum, frame) -> None:
        stop.set()
        if starting.is_set():
            starting.clear()
            raise _Stopped()

    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, handler)
    return starting


def _announce(options: DeployOptions, host: str, port: int) -> None:
    from xstage_dit.families import model_spec
    from xstage_dit.server.announce import ready_lines
    from xstage_dit.server.config import ServedModel

    served = ServedModel.from_spec(options.model, model_spec(options.model), sp=options.server.parallel.sp)
    replicas = (f"{options.autoscaling.min_replicas}..{options.autoscaling.max_replicas}"
                if options.autoscaling is not None else str(options.replicas))
    print(f"xstage-dit serve: {replicas} replica(s) of {options.world_size} rank(s) on Ray Serve", file=sys.stderr,
          flush=True)
    for line in ready_lines(served, f"http://{host}:{port}", options.world_size,
                            needs_key=options.server.api_key is not None):
        print(line, file=sys.stderr, flush=True)
