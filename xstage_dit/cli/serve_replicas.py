"""`xstage-dit serve --replicas N` (or ``--min-replicas / --max-replicas``): the same server as replicas of the
engine on Ray Serve (`xstage_dit.deploy`), each replica ``sp * cfg`` ranks, on a local Ray cluster or on the one
``--ray-address`` names.

Example::

    xstage-dit serve --model tiny-flux --sp 2 --replicas 2 --port 8000
    xstage-dit serve --model full-flux --sp 4 --min-replicas 1 --max-replicas 4 --ray-address auto
"""

from __future__ import annotations

import argparse

from xstage_dit.errors import UsageError


def add_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas on Ray Serve (needs the ray extra: pip install 'xstage_dit[ray]')")
    g.add_argument("--replicas", type=int, default=None,
                   help="serve N replicas of the engine (each sp*cfg ranks) on Ray Serve instead of one process group")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscale on queue length: at least this many")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscale on queue length: at most this many")
    g.add_argument("--target-ongoing-requests", type=float, default=2.0,
                   help="autoscaling aims at this many requests in flight per replica; default: %(default)s")
    g.add_argument("--upscale-delay", type=float, default=30.0,
                   help="seconds the demand must hold before a replica is added; default: %(default)s")
    g.add_argument("--downscale-delay", type=float, default=600.0,
                   help="seconds the demand must stay low before a replica drains and goes; default: %(default)s")
    g.add_argument("--ray-address", default=None,
                   help="an existing Ray cluster (auto, HOST:6379, ray://HOST:10001); default: start one here")
    g.add_argument("--gpus-per-rank", type=float, default=None,
                   help="GPUs of each rank (0: CPU ranks); default: 1 when the cluster has GPUs, else 0")
    g.add_argument("--cpus-per-rank", type=float, default=1.0, help="CPUs of each rank; default: %(default)s")


def wanted(args: argparse.Namespace) -> bool:
    """Whether the command serves replicas on Ray (a replica option was given); UsageError for a lone Ray option."""
    replicas = any(getattr(args, name, None) is not None for name in ("replicas", "min_replicas", "max_replicas"))
    if not replicas and getattr(args, "ray_address", None) is not None:
        raise UsageError(f"--ray-address: expected --replicas or --min-replicas/--max-replicas with it, got "
                         f"{args.ray_address!r} alone")
    return replicas


def options(args: argparse.Namespace, config) -> "object":
    """The `DeployOptions` of the command (its `ServerConfig` and engine options); UsageError naming a bad option."""
    from xstage_dit.cli.compile_options import compile_extras
    from xstage_dit.cli.engine_options import feature_switches, lora_options
    from xstage_dit.deploy.options import Autoscaling, DeployOptions

    scaling = None
    if args.min_replicas is not None or args.max_replicas is not None:
        if args.replicas is not None:
            raise UsageError(f"--replicas: expected --replicas or --min-replicas/--max-replicas (autoscaling), got "
                             f"both (--replicas {args.replicas})")
        lowest = args.min_replicas if args.min_replicas is not None else 1
        try:
            scaling = Autoscaling(min_replicas=lowest,
                                  max_replicas=args.max_replicas if args.max_replicas is not None else lowest,
                                  target_ongoing_requests=args.target_ongoing_requests,
                                  upscale_delay_s=args.upscale_delay, downscale_delay_s=args.downscale_delay)
        except ValueError as exc:
            raise _usage(exc) from None
    engine = {"max_compiled_shapes": args.max_compiled_shapes, "compile_guards": args.compile_guards,
              "compile_extras": compile_extras(args), "features": feature_switches(args),
              "lora": lora_options(args)[0]}
    try:
        return DeployOptions(model=args.model, server=config, dtype=args.dtype, weights_seed=args.weights_seed,
                             compile=args.compile, engine=engine, autoscaling=scaling, cpus_per_rank=args.cpus_per_rank,
                             replicas=1 if args.replicas is None else args.replicas,
                             gpus_per_rank=1.0 if args.gpus_per_rank is None else args.gpus_per_rank)
    except ValueError as exc:
        raise _usage(exc) from None


#: DeployOptions / Autoscaling field -> its option
FLAGS = {"upscale_delay_s": "--upscale-delay", "downscale_delay_s": "--downscale-delay"}


def _usage(exc: ValueError) -> UsageError:
    """The UsageError of a DeployOptions / Autoscaling error ("field: expected X, got Y"), naming the option."""
    field, _, rest = str(exc).partition(":")
    return UsageError(f"{FLAGS.get(field, '--' + field.replace('_', '-'))}: {rest.strip()}")


def run(args: argparse.Namespace, config) -> int:
    """Serve the replicas until interrupted (`deploy.application.run`)."""
    import os

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise UsageError("--replicas: expected a plain command (Ray starts every replica's ranks), got a rank "
                         "started by torchrun")
    deploy = options(args, config)
    from xstage_dit.deploy.application import run as serve_on_ray

    return serve_on_ray(deploy, ray_address=args.ray_address, host=args.host, port=args.port,
                        gpus_per_rank=args.gpus_per_rank)
