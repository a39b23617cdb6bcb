"""Replicas of the parallel engine on Ray Serve: each replica is one engine of ``sp * cfg`` ranks (Ray actors in one
STRICT_PACK placement group), serving the server's own FastAPI app; the replicas share video jobs through a job
directory, retry requests that never started, and answer ``/health`` and ``/metrics`` for the whole deployment.

Start it with ``xstage-dit serve --replicas N [--ray-address ADDR]`` or with Ray's own command::

    serve run xstage_dit.deploy:app model=tiny-flux sp=2 replicas=2 gpus_per_rank=0

Needs the ``ray`` extra (``pip install 'xstage_dit[ray]'``). docs/ray.md says how it works, how to run it on a
multi-node cluster and on Kubernetes (KubeRay), and what a replica needs.
"""

from __future__ import annotations

from xstage_dit.deploy.options import Autoscaling, DeployOptions

__all__ = ["Autoscaling", "DeployOptions", "app"]


def app(args: dict):
    """The application builder of ``serve run xstage_dit.deploy:app key=value ...`` (see `DeployOptions.from_args`);
    Ray Serve is imported only here, so the package imports without the ``ray`` extra."""
    from xstage_dit.deploy.application import app as build_app

    return build_app(args)
