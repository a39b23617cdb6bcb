"""The options `generate`, `serve` and `bench` share for the feature stack, and the `EngineConfig` they make.

--no-host-syncs / --no-text-depth / --no-prompt-cache / --no-one-frame-vae: turn one feature of the stack off
(each is on by default; `xstage_dit.features.stack.FEATURES` says what each does). --quantize fp8 (with
--fp8-granularity) puts the transformer's linear layers in float8 (`xstage_dit.features.fp8`). --cache (with its
--cache-* parameters) runs one of diffusers' step caches with one decision for all ranks (`xstage_dit.features.step_cache`).
The compile options are `cli.compile_options`'; the parallel degrees `cli.parallel_config`'s.
"""

from __future__ import annotations

import argparse

from xstage_dit.errors import UsageError

# flag -> (EngineConfig field, what turning it off skips)
FEATURE_FLAGS = {
    "--no-host-syncs": ("host_syncs", "keep a transformer's per-forward host copies (NucleusMoE's rope tables)"),
    "--no-text-depth": ("text_depth", "run the text encoder's layers past the deepest hidden state read"),
    "--no-prompt-cache": ("prompt_cache", "encode CFG's empty negative prompt on every call"),
    "--no-one-frame-vae": ("one_frame_vae", "decode a one-frame latent through the video VAE's 3-D path"),
}


def add_feature_options(parser: argparse.ArgumentParser) -> None:
    """The --no-<feature> switches of the stack (every feature on by default), --quantize and --cache."""
    from xstage_dit.features.fp8 import GRANULARITIES

    for flag, (_, skips) in FEATURE_FLAGS.items():
        parser.add_argument(flag, action="store_true", help=f"feature off: {skips}")
    parser.add_argument("--quantize", choices=("none", "fp8"), default="none",
                        help="fp8: the transformer's linear layers in float8 through torchao (a GPU of compute "
                             "capability >= 8.9; lossy: docs/performance.md says by how much)")
    parser.add_argument("--fp8-granularity", choices=GRANULARITIES, default="row",
                        help="with --quantize fp8: row (per-token activations x per-channel weights), tensor, or "
                             "weight (weights stored in float8, bf16 GEMMs: memory, not speed)")
    add_cache_options(parser)


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


def check_cache(args: argparse.Namespace, spec, parallel, compile_mode: str | None) -> None:
    """What refuses --cache before any rank starts: compile mode graphs, pab / fastercache under CFG parallel of a
    family whose CFG is two calls a step (its record says); UsageError naming --cache."""
    config = cache_config(args)
    if config is None:
        return
    from xstage_dit.families.registry import records
    from xstage_dit.features.step_cache import SHARED_BRANCH_STATE

    if compile_mode == "graphs":
        raise UsageError(f"--cache: {config.method} with --compile graphs: a CUDA graph replays one recorded forward "
                         "and a step cache changes what a forward runs from step to step; expected --compile off, "
                         "regional or full")
    family = records().get(spec.family)
    paired = family is not None and family.sp.cfg == "paired"
    if config.method in SHARED_BRANCH_STATE and parallel.cfg > 1 and paired:
        raise UsageError(f"--cache: {config.method} under --cfg {parallel.cfg}: diffusers keeps one {config.method} "
                         "state for a step's cond and uncond calls, and each CFG rank sees one of them; expected "
                         "--cfg 1 or --cache fbcache, taylorseer or magcache")


def feature_switches(args: argparse.Namespace) -> dict:
    """The `EngineConfig` fields the feature options set: the switches --no-<feature> turned off, quantize /
    fp8_granularity where --quantize fp8 was given, cache where --cache was ({} when no option was given)."""
    switches: dict = {field: False for flag, (field, _) in FEATURE_FLAGS.items()
                      if getattr(args, flag.lstrip("-").replace("-", "_"), False)}
    if getattr(args, "quantize", "none") != "none":
        switches.update(quantize=args.quantize, fp8_granularity=getattr(args, "fp8_granularity", "row"))
    cache = cache_config(args)
    if cache is not None:
        switches["cache"] = cache
    return switches


def compile_config(args: argparse.Namespace, device):
    """The `CompileConfig` of --compile (its default for `device` when left out), --max-compiled-shapes,
    --compile-guards and --compile-extra; UsageError naming a bad value."""
    from xstage_dit.cli.compile_options import compile_extras, compile_mode
    from xstage_dit.features.compile import CompileConfig

    try:
        return CompileConfig(compile_mode(args, device), getattr(args, "max_compiled_shapes", 8),
                             guards=getattr(args, "compile_guards", "full"), extras=compile_extras(args))
    except ValueError as exc:
        raise UsageError(f"--compile: {exc}") from None


def check_quantize(args: argparse.Namespace, device=None) -> None:
    """UsageError naming --quantize where its FP8 GEMMs cannot run on `device` (None: the GPU where there is one,
    else the CPU), before any rank starts or any weight loads."""
    if getattr(args, "quantize", "none") == "none":
        return
    import torch

    from xstage_dit.features.fp8 import require_fp8_device

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        require_fp8_device(torch.device(device), args.fp8_granularity)
    except ValueError as exc:
        raise UsageError(f"--quantize fp8: {exc}") from None
