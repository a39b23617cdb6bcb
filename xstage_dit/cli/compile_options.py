"""The options `serve`, `generate` and `bench` share for torch.compile and warm-up, and their checks.

--compile {off,regional,full,graphs}: `xstage_dit.features.compile` (default: regional on a GPU, off on a CPU).
--warmup-sizes WxH[,WxH...]: extra sizes compiled (and, for serve, measured by the batcher) at warm-up.
--max-compiled-shapes N: transformer input shapes compiled before further ones run eager.
--compile-guards {full,warm}: Dynamo's guards on every call, or only the differentiating ones once warm.
--compile-extra NAME[,NAME]: more to compile (`apply_compile`'s extras: text-encoder, video-vae).
"""

from __future__ import annotations

import argparse

from xstage_dit.errors import UsageError
from xstage_dit.features.compile import COMPILE_MODES as COMPILE_CHOICES, GUARD_MODES, GUARDS_HELP


def add_compile_option(parser: argparse.ArgumentParser, *, optional_value: bool = False) -> None:
    """--compile MODE (and, with optional_value, a bare --compile meaning regional: bench's older spelling)."""
    extra = {"nargs": "?", "const": "regional"} if optional_value else {}
    parser.add_argument("--compile", default=None, metavar="{" + ",".join(COMPILE_CHOICES) + "}", **extra,
                        help="torch.compile of the transformer after parallelize: regional = diffusers' "
                             "compile_repeated_blocks (the whole transformer where it has no repeated blocks), "
                             "full = the whole transformer forward, graphs = full under CUDA graphs (not "
                             "measured yet); default: regional on a GPU, off on a CPU")
    parser.add_argument("--compile-guards", choices=GUARD_MODES, default="full", help=GUARDS_HELP)
    add_compile_extra_option(parser)
    parser.add_argument("--max-compiled-shapes", type=int, default=8,
                        help="input shapes compiled before further ones run eager (logged once each); "
                             "default: %(default)s")


def add_compile_extra_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile-extra", default="", metavar="NAME[,NAME]",
                        help="with --compile, also compile (not measured on a GPU yet): text-encoder = an LLM text "
                             "encoder's language model whole, one graph for every prompt length (NucleusMoE's "
                             "Qwen3-VL, FLUX.2's Mistral); video-vae = a video VAE's decode of several frames, chunk "
                             "by chunk (Wan's); default: none")


def compile_extras(args: argparse.Namespace) -> tuple[str, ...]:
    """The --compile-extra names as a tuple; UsageError naming one that is not known."""
    from xstage_dit.features.compile import parse_extras

    try:
        return parse_extras(getattr(args, "compile_extra", ""))
    except ValueError as exc:
        raise UsageError(f"--compile-extra: {exc}") from None


def add_warmup_sizes_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--warmup-sizes", default="", metavar="WxH[,WxH...]",
                        help="sizes warmed up (compiled, and measured by the batcher) besides the model's "
                             "default, e.g. 512x512,768x1024; default: none")


def parse_warmup_sizes(text: str, spec=None, sp: int = 1) -> tuple:
    """((width, height), ...) of a --warmup-sizes value; UsageError naming a bad entry (and, with the
    model's `spec`, a size the model cannot make at `sp` sequence-parallel ranks)."""
    sizes = []
    for part in [p.strip() for p in str(text or "").split(",") if p.strip()]:
        width, sep, height = part.lower().partition("x")
        if not sep or not width.isdigit() or not height.isdigit() or int(width) < 1 or int(height) < 1:
            raise UsageError(f"--warmup-sizes: expected WxH[,WxH...] with positive integers, got {part!r}")
        size = (int(width), int(height))
        if spec is not None:
            try:
                spec.check_size(size[1], size[0], spec.frames, sp=sp)
            except ValueError as exc:
                raise UsageError(f"--warmup-sizes: {part}: {exc}") from None
        sizes.append(size)
    return tuple(sizes)


def check_compile_args(args: argparse.Namespace) -> None:
    """UsageError naming a bad --compile, --max-compiled-shapes or --compile-guards value."""
    if args.compile is not None and args.compile not in COMPILE_CHOICES:
        raise UsageError(f"--compile: expected one of {', '.join(COMPILE_CHOICES)}, got {args.compile!r}")
    shapes = getattr(args, "max_compiled_shapes", 8)
    if not isinstance(shapes, int) or shapes < 1:
        raise UsageError(f"--max-compiled-shapes: expected an integer >= 1, got {shapes!r}")
    guards = getattr(args, "compile_guards", "full")
    if guards not in GUARD_MODES:
        raise UsageError(f"--compile-guards: expected one of {', '.join(GUARD_MODES)}, got {guards!r}")
    compile_extras(args)


def compile_mode(args: argparse.Namespace, device) -> str:
    """The --compile value, or its default for `device` (regional on a GPU, off on a CPU)."""
    from xstage_dit.features.compile import default_compile_mode

    return args.compile or default_compile_mode(device)
