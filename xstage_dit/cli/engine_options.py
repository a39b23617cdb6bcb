"""The options `generate`, `serve` and `bench` share for the feature stack, and the `EngineConfig` they make.

--no-host-syncs / --no-text-depth / --no-prompt-cache / --no-one-frame-vae: turn one feature of the stack off
(each is on by default; `xstage_dit.features.stack.FEATURES` says what each does). The compile options are
`cli.compile_options`'; the parallel degrees `cli.parallel_config`'s.
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
    """The --no-<feature> switches of the stack (every feature on by default)."""
    for flag, (_, skips) in FEATURE_FLAGS.items():
        parser.add_argument(flag, action="store_true", help=f"feature off: {skips}")


def feature_switches(args: argparse.Namespace) -> dict[str, bool]:
    """The `EngineConfig` switches the --no-<feature> options turned off ({} when none was given)."""
    return {field: False for flag, (field, _) in FEATURE_FLAGS.items()
            if getattr(args, flag.lstrip("-").replace("-", "_"), False)}


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
