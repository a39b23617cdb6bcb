"""The step cache's command-line options (--cache and its --cache-* parameters), shared by ``xstage-dit generate``,
``serve`` and ``bench`` (`cli.engine_options` and `bench.options` register them), and the `StepCacheConfig` they
make. Only the standard library at import: the commands check options before torch or diffusers load.
"""

from __future__ import annotations

import argparse

from xstage_dit.errors import UsageError

__all__ = ["CACHE_OPTIONS", "add_cache_options", "cache_config"]

# --cache-<name> -> (StepCacheConfig field, argparse type, help); which methods take each: step_cache.config.PARAMETERS
CACHE_OPTIONS = {
    "--cache-threshold": ("threshold", float, "fbcache: skip the other blocks while the first block's residual changed "
                          "by less than this (relative L1, the whole image; 0 never skips; default 0.05); magcache: "
                          "the accumulated error budget (default 0.06); a request may set its own (cache_threshold)"),
    "--cache-compute-every": ("compute_every", int, "a forced schedule: a full step every N steps (0, N, 2N, ...), the "
                              "others cached (fbcache, taylorseer, magcache, pab): for benchmarks at fixed ratios"),
    "--cache-interval": ("interval", int, "taylorseer: steps between full computations (default 5); pab / "
                         "fastercache: attention computed every N calls (default 2)"),
    "--cache-warmup-steps": ("warmup_steps", int, "taylorseer: full steps first (default 3)"),
    "--cache-max-order": ("max_order", int, "taylorseer: order of the Taylor prediction (default 1)"),
    "--cache-max-skip": ("max_skip", int, "magcache: consecutive skipped steps at most (default 3)"),
    "--cache-retention": ("retention", float, "magcache: share of first steps never skipped (default 0.2)"),
    "--cache-mag-ratios": ("mag_ratios", str, "magcache: the model's magnitude ratios: flux (diffusers' FLUX.1 ratios, "
                           "the default), flat, or r0,r1,..."),
    "--cache-timestep-range": ("timestep_range", str, "pab / fastercache: LO,HI timesteps (of 0..1000) where "
                               "attention may be reused (defaults 100,800 / -1,681)"),
}


def add_cache_options(parser: argparse.ArgumentParser) -> None:
    """--cache and its --cache-* parameters (`xstage_dit.features.step_cache.config`)."""
    from xstage_dit.features.step_cache.config import METHODS

    parser.add_argument("--cache", choices=("none",) + METHODS, default="none",
                        help="a step cache (diffusers' hooks; one skip-or-compute decision for every rank and CFG "
                             "branch; lossy: docs/serving.md): fbcache (First Block Cache), taylorseer, magcache, "
                             "pab (Pyramid Attention Broadcast), fastercache; default: %(default)s")
    for flag, (_, kind, text) in CACHE_OPTIONS.items():
        parser.add_argument(flag, type=kind, default=None, help=text)
    parser.add_argument("--cache-lite", action="store_true", help="taylorseer: lite mode (the final projection "
                                                                   "predicted, blocks skipped)")


def cache_config(args: argparse.Namespace):
    """The `StepCacheConfig` of --cache and its parameters (None for --cache none); UsageError naming the option
    whose value (or whose method) is wrong."""
    from xstage_dit.features.step_cache.config import StepCacheConfig, parse_mag_ratios, parse_timestep_range

    method = getattr(args, "cache", "none")
    values = {field: getattr(args, flag[2:].replace("-", "_"), None) for flag, (field, _, _) in CACHE_OPTIONS.items()}
    if getattr(args, "cache_lite", False):
        values["lite"] = True
    given = {k: v for k, v in values.items() if v is not None}
    if method == "none":
        if given:
            flag = next(f for f, (field, _, _) in CACHE_OPTIONS.items() if field in given) if set(given) - {"lite"} \
                else "--cache-lite"
            raise UsageError(f"{flag}: expected --cache with it, got --cache none")
        return None
    flags = {field: flag for flag, (field, _, _) in CACHE_OPTIONS.items()} | {"lite": "--cache-lite"}
    for field, parse in (("mag_ratios", parse_mag_ratios), ("timestep_range", parse_timestep_range)):
        if field in given:
            try:
                given[field] = parse(given[field])
            except ValueError as exc:
                raise UsageError(f"{flags[field]}: {exc}") from None
    try:
        return StepCacheConfig(method, **given)
    except ValueError as exc:
        flag = next((flags[f] for f in flags if f" {f} " in f" {exc} ".replace(":", " ")), "--cache")
        raise UsageError(f"{flag}: {exc}") from None
