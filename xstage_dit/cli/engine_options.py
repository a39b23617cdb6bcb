"""The options `generate`, `serve` and `bench` share for the feature stack, and the `EngineConfig` they make.

--no-host-syncs / --no-text-depth / --no-prompt-cache / --no-one-frame-vae: turn one feature of the stack off
(each is on by default; `xstage_dit.features.stack.FEATURES` says what each does). --quantize fp8 (with
--fp8-granularity) puts the transformer's linear layers in float8 (`xstage_dit.features.fp8`), and with
--fp8-attention auto its attention may run on 8-bit kernels where the kernel sweep measured them faster. --cache
(with its --cache-* parameters) runs one of diffusers' step caches with one decision for all ranks
(`xstage_dit.features.step_cache`). The compile options are `cli.compile_options`'; the parallel degrees `cli.parallel_config`'s.
"""

from __future__ import annotations

import argparse

from xstage_dit.errors import UsageError
from xstage_dit.features.step_cache.options import add_cache_options, cache_config

# flag -> (EngineConfig field, what turning it off skips)
FEATURE_FLAGS = {
    "--no-host-syncs": ("host_syncs", "keep a transformer's per-forward host copies (NucleusMoE's rope tables)"),
    "--no-text-depth": ("text_depth", "run the text encoder's layers past the deepest hidden state read"),
    "--no-prompt-cache": ("prompt_cache", "encode CFG's empty negative prompt on every call"),
    "--no-one-frame-vae": ("one_frame_vae", "decode a one-frame latent through the video VAE's 3-D path"),
}


def add_feature_options(parser: argparse.ArgumentParser) -> None:
    """The --no-<feature> switches of the stack (every feature on by default), --quantize and --cache."""
    from xstage_dit.features.fp8 import FP8_ATTENTION, GRANULARITIES

    for flag, (_, skips) in FEATURE_FLAGS.items():
        parser.add_argument(flag, action="store_true", help=f"feature off: {skips}")
    parser.add_argument("--quantize", choices=("none", "fp8"), default="none",
                        help="fp8: the transformer's linear layers in float8 through torchao (a GPU of compute "
                             "capability >= 8.9; lossy: docs/performance.md says by how much)")
    parser.add_argument("--fp8-granularity", choices=GRANULARITIES, default="row",
                        help="with --quantize fp8: row (per-token activations x per-channel weights), tensor, block "
                             "(1 x 128 activation and 128 x 128 weight blocks), or weight (weights stored in float8, "
                             "bf16 GEMMs: memory, not speed)")
    parser.add_argument("--fp8-attention", choices=FP8_ATTENTION, default="off",
                        help="with --quantize fp8: auto = 8-bit attention kernels (cuDNN FP8 SDPA, SageAttention) join "
                             "the attention kernel sweep and run where measured faster (lossy: docs/performance.md); "
                             "a kernel's name runs that kernel wherever it takes the shape; default: %(default)s")
    add_cache_options(parser)


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
        switches.update(quantize=args.quantize, fp8_granularity=getattr(args, "fp8_granularity", "row"),
                        fp8_attention=getattr(args, "fp8_attention", "off"))
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
    else the CPU), or --fp8-attention without --quantize fp8, before any rank starts or any weight loads."""
    attention = getattr(args, "fp8_attention", "off")
    if getattr(args, "quantize", "none") == "none":
        if attention != "off":
            raise UsageError(f"--fp8-attention {attention}: expected --quantize fp8 (FP8 attention is part of the FP8 "
                             "mode), got --quantize none")
        return
    import torch

    from xstage_dit.features.fp8 import refuse_fp8_with_lora, require_fp8_device

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    lora = bool(getattr(args, "lora_dir", None) or getattr(args, "preload_loras", "") or getattr(args, "lora", []))
    try:
        refuse_fp8_with_lora(args.quantize, lora)  # the engine's rule, before any rank starts
        require_fp8_device(torch.device(device), args.fp8_granularity)
    except ValueError as exc:
        raise UsageError(f"--quantize fp8: {exc}") from None


def add_lora_options(parser: argparse.ArgumentParser, *, serve: bool) -> None:
    """The LoRA options (`features.lora`): --lora-dir, --max-loras, --max-lora-rank, --max-loras-per-request,
    --lora-mode, and serve's --preload-loras a,b or generate's repeatable --lora NAME[:SCALE] (NAME a name in
    --lora-dir or a path)."""
    from xstage_dit.features.lora.config import (DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, DEFAULT_PER_REQUEST,
                                                 MAX_SCALE, MIN_SCALE, MODES)

    parser.add_argument("--lora-dir", default=None,
                        help="folder of LoRA adapters (.safetensors files or diffusers LoRA folders, named by file or "
                             "folder name) that requests may name")
    parser.add_argument("--max-loras", type=int, default=DEFAULT_MAX_LORAS,
                        help="adapters resident at once (least recently used evicted); default: %(default)s")
    parser.add_argument("--max-lora-rank", type=int, default=DEFAULT_MAX_LORA_RANK,
                        help="largest adapter rank accepted (with --compile: the rank hot-swap slots are compiled "
                             "at); default: %(default)s")
    parser.add_argument("--max-loras-per-request", type=int, default=DEFAULT_PER_REQUEST,
                        help="adapters one request may combine (with --compile: slots compiled in, each a rank "
                             "--max-lora-rank pass in a LoRA request); default: %(default)s")
    parser.add_argument("--lora-mode", choices=MODES, default="auto",
                        help="fused: a request's adapters merged into the weights for its call (a saved copy of "
                             "each targeted weight; the speed of no LoRA); unfused: the LoRA layers run; auto: fused "
                             "on a GPU where the copy fits, else unfused; default: %(default)s")
    if serve:
        parser.add_argument("--preload-loras", default="",
                            help="comma-separated adapter names (or paths) loaded at start-up")
    else:
        parser.add_argument("--lora", action="append", default=[], metavar="NAME[:SCALE]",
                            help=f"apply a LoRA adapter (repeatable; a name in --lora-dir or a file/folder path; "
                                 f"scale in [{MIN_SCALE:g}, {MAX_SCALE:g}], default 1)")


def lora_options(args: argparse.Namespace) -> tuple[dict, tuple]:
    """(`EngineConfig` LoRA fields, the request's ((name, scale), ...)) of the LoRA options; UsageError naming a bad
    one. generate's --lora paths become preloaded adapters named by file stem."""
    import os

    from xstage_dit.features.lora.config import parse_adapter_arg

    fields = {"lora_dir": args.lora_dir, "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank,
              "max_loras_per_request": args.max_loras_per_request, "lora_mode": getattr(args, "lora_mode", "auto")}
    preload = [p.strip() for p in getattr(args, "preload_loras", "").split(",") if p.strip()]
    wanted = []
    for text in getattr(args, "lora", []):
        try:
            name, scale = parse_adapter_arg(text)
        except ValueError as exc:
            raise UsageError(f"--lora: {exc}") from None
        if os.sep in name or os.path.exists(name):
            preload.append(name)
            name = os.path.basename(os.path.normpath(name)).removesuffix(".safetensors")
        elif args.lora_dir is None:
            raise UsageError(f"--lora: expected a file or folder path, or --lora-dir holding {name!r}, got neither")
        wanted.append((name, scale))
    if wanted:
        fields["max_loras"] = max(fields["max_loras"], len(wanted))
        fields["max_loras_per_request"] = max(fields["max_loras_per_request"], len(wanted))
    fields["preload_loras"] = tuple(preload)
    if fields["lora_dir"] is None and not preload:
        return {}, ()
    return fields, tuple(wanted)
