"""What a Ray Serve deployment of the engine is made of: `DeployOptions` (the model and its server settings, how
many replicas or how to autoscale them, each rank's resources, health checks, draining, retries) and
`Autoscaling`, both validated on construction; `DeployOptions.from_args` reads the ``key=value`` arguments of
``serve run xstage_dit.deploy:app ...``.

Example::

    DeployOptions(model="tiny-flux", server=ServerConfig(parallel=ParallelConfig(sp=2)), replicas=2,
                  gpus_per_rank=0)            # two replicas of two CPU ranks each
    DeployOptions.from_args({"model": "tiny-flux", "sp": "2", "replicas": "2", "gpus_per_rank": "0"})
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from xstage_dit.features.config import ParallelConfig
from xstage_dit.server.config import ServerConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
#: Requests a replica holds besides its queue and batch: polls, event streams and downloads of video jobs.
STREAM_ALLOWANCE = 64


def _check(cond: bool, what: str, expected: str, got: Any) -> None:
    if not cond:
        raise ValueError(f"{what}: expected {expected}, got {got!r}")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class Autoscaling:
    """Ray Serve's autoscaling on queue length (``autoscaling_config``): replicas between `min_replicas` and
    `max_replicas`, aiming at `target_ongoing_requests` requests in flight per replica (a waiting or running image
    request is one; a video job counts while a request follows it). upscale / downscale delays: how long the
    demand must hold before a replica is added / removed (a removed replica first drains: `DeployOptions`).
    metrics_interval_s / look_back_period_s: how often replicas report, over what window Serve averages.
    initial_replicas: how many to start with (None: min_replicas)."""

    min_replicas: int = 1
    max_replicas: int = 2
    target_ongoing_requests: float = 2.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    metrics_interval_s: float = 10.0
    look_back_period_s: float = 30.0
    initial_replicas: int | None = None

    def __post_init__(self) -> None:
        _check(_positive_int(self.min_replicas), "min_replicas", "an integer >= 1 (a replica takes minutes to "
                                                                 "load: no scaling to zero)", self.min_replicas)
        _check(_positive_int(self.max_replicas) and self.max_replicas >= self.min_replicas, "max_replicas",
               f"an integer >= min_replicas ({self.min_replicas})", self.max_replicas)
        _check(self.target_ongoing_requests > 0, "target_ongoing_requests", "a number > 0",
               self.target_ongoing_requests)
        for name in ("upscale_delay_s", "downscale_delay_s"):
            _check(math.isfinite(getattr(self, name)) and getattr(self, name) >= 0, name, "a number >= 0",
                   getattr(self, name))
        if self.initial_replicas is not None:
            _check(_positive_int(self.initial_replicas) and self.min_replicas <= self.initial_replicas
                   <= self.max_replicas, "initial_replicas", f"an integer in [{self.min_replicas}, "
                                                             f"{self.max_replicas}] or None", self.initial_replicas)
        for name in ("metrics_interval_s", "look_back_period_s"):
            _check(math.isfinite(getattr(self, name)) and getattr(self, name) > 0, name, "a number > 0",
                   getattr(self, name))

    def serve_config(self) -> dict:
        """Ray Serve's ``autoscaling_config``."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DeployOptions:
    """One deployment of the engine on Ray Serve.

    model: a built-in model name or a local diffusers folder (on every node, at the same path).
    server: the server's settings, as ``xstage-dit serve`` takes them; ``server.parallel`` (sp, ep, cfg) makes each
        replica's world of ``sp * cfg`` ranks.
    dtype / weights_seed / compile / engine: `startup.model_loader`'s arguments (engine: its other keywords, as
        the CLI builds them: max_compiled_shapes, compile_guards, compile_extras, features, lora).
    replicas: a fixed number of replicas; autoscaling: instead, Serve's autoscaling (`Autoscaling`).
    gpus_per_rank / cpus_per_rank: each rank's bundle of the replica's placement group (0 GPUs: CPU ranks, gloo).
    health_check_period_s / health_check_timeout_s: Serve's health check of a replica (it fails once the engine
        failed; three failures in a row and Serve replaces the replica).
    graceful_shutdown_timeout_s: how long a replica removed by a scale-down (or an update) may drain its running
        and queued jobs before Serve kills it; None: the server's request timeout plus 30 s.
    routing_stats_period_s: how often a replica tells the router whether its engine is ready.
    retry: retry once on another replica a request that got 503 before any of its work started; retry_wait_s: how
        long that retry waits for another ready replica before the 503 stands.
    start_timeout_s: load + warm-up (+ compile) of one replica before its start counts as failed.
    app_name: the Serve application's name.
    """

    model: str = "tiny-flux"
    server: ServerConfig = field(default_factory=ServerConfig)
    dtype: str = "auto"
    weights_seed: int = 0
    compile: str | None = None
    engine: dict = field(default_factory=dict)
    replicas: int = 1
    autoscaling: Autoscaling | None = None
    gpus_per_rank: float = 1.0
    cpus_per_rank: float = 1.0
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 30.0
    graceful_shutdown_timeout_s: float | None = None
    routing_stats_period_s: float = 1.0
    retry: bool = True
    retry_wait_s: float = 60.0
    start_timeout_s: float = 1800.0
    app_name: str = "xstage"

    def __post_init__(self) -> None:
        _check(bool(self.model), "model", "a model name or folder", self.model)
        _check(isinstance(self.server, ServerConfig), "server", "a ServerConfig", self.server)
        _check(self.dtype in DTYPES, "dtype", f"one of {DTYPES}", self.dtype)
        _check(_positive_int(self.replicas), "replicas", "an integer >= 1", self.replicas)
        _check(self.autoscaling is None or isinstance(self.autoscaling, Autoscaling), "autoscaling",
               "an Autoscaling or None", self.autoscaling)
        _check(self.gpus_per_rank >= 0, "gpus_per_rank", "a number >= 0", self.gpus_per_rank)
        _check(self.cpus_per_rank > 0, "cpus_per_rank", "a number > 0", self.cpus_per_rank)
        for name in ("health_check_period_s", "health_check_timeout_s", "routing_stats_period_s", "retry_wait_s",
                     "start_timeout_s"):
            value = getattr(self, name)
            _check(math.isfinite(value) and value > 0, name, "a number > 0", value)
        if self.graceful_shutdown_timeout_s is not None:
            _check(self.graceful_shutdown_timeout_s > 0, "graceful_shutdown_timeout_s", "a number > 0 or None",
                   self.graceful_shutdown_timeout_s)
        _check(bool(self.app_name) and "#" not in self.app_name, "app_name", "a non-empty name without '#'",
               self.app_name)

    @property
    def world_size(self) -> int:
        return self.server.parallel.world_size

    @property
    def graceful_s(self) -> float:
        """How long a replica may drain (see `graceful_shutdown_timeout_s`)."""
        if self.graceful_shutdown_timeout_s is not None:
            return self.graceful_shutdown_timeout_s
        return self.server.request_timeout_s + 30.0

    @property
    def max_ongoing_requests(self) -> int:
        """Requests Serve sends one replica at once: its queue, a batch, and `STREAM_ALLOWANCE` polls and streams
        (the engine answers 429 beyond its queue by itself)."""
        return self.server.max_queue + self.server.max_batch_size + STREAM_ALLOWANCE

    def bundle(self) -> dict[str, float]:
        """One rank's bundle of the replica's placement group."""
        return {"CPU": self.cpus_per_rank, **({"GPU": self.gpus_per_rank} if self.gpus_per_rank else {})}

    def loader_kwargs(self) -> dict:
        """`startup.model_loader`'s keywords besides the model and the ParallelConfig (dtype as a torch dtype)."""
        import torch

        dtype = None if self.dtype == "auto" else getattr(torch, self.dtype)
        return {"dtype": dtype, "weights_seed": self.weights_seed, "compile": self.compile, **self.engine}

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> "DeployOptions":
        """From ``serve run xstage_dit.deploy:app key=value ...`` (strings, or values of their type): ``model``;
        ``sp`` / ``ep`` / ``cfg`` / ``collective_timeout_s``; ``replicas``, or ``min_replicas`` and
        ``max_replicas`` (autoscaling, with the other `Autoscaling` fields); the other `DeployOptions` fields but
        ``server`` / ``engine``; and `ServerConfig` fields with a number, text or yes/no value (``max_batch_size``,
        ``batching``, ``warmup``...). ValueError naming an unknown or bad argument."""
        from xstage_dit.deploy.args import split_args

        return split_args(cls, Autoscaling, args)
