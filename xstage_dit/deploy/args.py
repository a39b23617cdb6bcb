"""The ``key=value`` arguments of ``serve run xstage_dit.deploy:app ...`` turned into `DeployOptions`: each value
converted to its field's type (``serve run`` passes strings), each key checked against the fields it may set.

Example: ``{"model": "tiny-flux", "sp": "2", "replicas": "2", "max_batch_size": "1", "warmup": "false"}``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from xstage_dit.features.config import ParallelConfig
from xstage_dit.server.config import ServerConfig

PARALLEL_ARGS = {"sp": int, "ep": int, "cfg": int, "collective_timeout_s": float}
#: DeployOptions fields `serve run` may not set (built from the others) and their types (the rest).
_NOT_ARGS = ("server", "engine", "autoscaling")
_DEPLOY_TYPES = {"model": str, "dtype": str, "weights_seed": int, "compile": str, "replicas": int,
                 "gpus_per_rank": float, "cpus_per_rank": float, "health_check_period_s": float,
                 "health_check_timeout_s": float, "graceful_shutdown_timeout_s": float, "routing_stats_period_s": float,
                 "retry": bool, "retry_wait_s": float, "start_timeout_s": float, "app_name": str}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def convert(name: str, value: Any, kind: type) -> Any:
    """`value` as `kind` (int, float, bool or str); ValueError naming `name`."""
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    text = str(value).strip()
    try:
        if kind is bool:
            if text.lower() in _TRUE + _FALSE:
                return text.lower() in _TRUE
            raise ValueError
        return kind(text)
    except ValueError:
        expected = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[kind]
        raise ValueError(f"{name}: expected {expected}, got {value!r}") from None


def server_arg_types() -> dict[str, type]:
    """The ServerConfig fields an argument may set: those whose default is a number, a text or a yes/no."""
    out = {}
    for f in dataclasses.fields(ServerConfig):
        default = getattr(ServerConfig(), f.name)
        if f.name != "api_key" and isinstance(default, (bool, int, float, str)):
            out[f.name] = type(default)
    out["exit_after_failure_s"] = float
    return out


def split_args(options_cls: type, autoscaling_cls: type, args: dict[str, Any]):
    """`DeployOptions` of `args` (see `DeployOptions.from_args`)."""
    server_types = server_arg_types()
    autoscaling_types = {f.name: int if f.name == "initial_replicas" else type(getattr(autoscaling_cls(), f.name))
                         for f in dataclasses.fields(autoscaling_cls)}
    known = {**_DEPLOY_TYPES, **PARALLEL_ARGS, **server_types, **autoscaling_types}
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown argument; expected some of {sorted(known)}")
    values = {name: convert(name, value, known[name]) for name, value in args.items()}
    if "replicas" in values and ("min_replicas" in values or "max_replicas" in values):
        raise ValueError(f"replicas: expected replicas or min_replicas/max_replicas (autoscaling), got both "
                         f"({values['replicas']} and {values.get('min_replicas')}..{values.get('max_replicas')})")
    parallel = ParallelConfig(**{("timeout_s" if k == "collective_timeout_s" else k): values[k]
                                 for k in PARALLEL_ARGS if k in values})
    server = ServerConfig(parallel=parallel, **{k: v for k, v in values.items() if k in server_types})
    scaling = {k: v for k, v in values.items() if k in autoscaling_types}
    autoscaling = autoscaling_cls(**scaling) if "min_replicas" in scaling or "max_replicas" in scaling else None
    if autoscaling is None and scaling:
        raise ValueError(f"{sorted(scaling)[0]}: expected min_replicas or max_replicas with it (autoscaling), got "
                         f"neither")
    deploy = {k: v for k, v in values.items() if k in _DEPLOY_TYPES and k not in _NOT_ARGS}
    return options_cls(server=server, autoscaling=autoscaling, **deploy)
