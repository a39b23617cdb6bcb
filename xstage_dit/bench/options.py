"""The options of the end-to-end benchmark (``xstage-dit bench`` and ``python -m xstage_dit.bench.e2e`` take
exactly these), their checks, the contender names, and the command line that repeats a run.

Example::

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "tiny-flux", "--steps", "2"])
    validate(args)   # UsageError naming the bad value
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from xstage_dit.errors import UsageError
from xstage_dit.features.compile import COMPILE_MODES, GUARD_MODES, GUARDS_HELP, parse_extras
from xstage_dit.features.config import add_cfg_batch_option
from xstage_dit.features.step_cache.options import add_cache_options, cache_config

# Contender names in the order they run: the baseline first, the irreversible one (diffusers' native
# context parallelism has no public way to undo) after every reversible one.
CONTENDERS = ("diffusers", "xstage-serial", "xstage-calibrated", "xstage-cfgbatch", "xstage-served", "diffusers-fp8",
              "xstage-fp8", "xstage-fp8-served", "xstage-fp8-attn", "xstage-fp8-attn-served", "xfuser-usp",
              "xfuser-runner", "diffusers-cp")
DEFAULT_CONTENDERS = tuple(name for name in CONTENDERS if "fp8" not in name)
# The step caches, asked for by name: each stands for a contender per method and forced ratio
# (--cache-contender-methods / --cache-contender-every), run with the other reversible stacks.
CACHE_CONTENDERS = ("xstage-cache", "cache-dit")
BASELINE = "diffusers"
# Plain diffusers once more after the eager xstage contenders (an A/B/A order at --rounds 1).
BASELINE_REPEAT = "diffusers-repeat"
# Our group: the baseline and the xstage contenders. Their eager variants are reversible (apply/restore leave
# the pipeline as it was), which is what lets --rounds measure them in interleaved rounds.
OUR_FAMILIES = ("diffusers", "xstage-serial", "xstage-calibrated", "xstage-cfgbatch", "xstage-served", "diffusers-fp8",
                "xstage-fp8", "xstage-fp8-served", "xstage-fp8-attn", "xstage-fp8-attn-served")

# The sample prompts ship inside the package, so an installed wheel benchmarks too.
PROMPTS = Path(__file__).resolve().parent / "prompts.txt"
# Relative to the current directory: an installed wheel has no checkout to write into.
DEFAULT_OUT_DIR = str(Path("benchmarks") / "results")

DTYPES = ("auto", "bf16", "fp16", "fp32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register every option of the end-to-end benchmark on ``parser``."""
    parser.add_argument("--model", default="tiny-flux",
                        help="built-in model name (tiny-flux, full-flux, full-wan, full-nucleusmoe, ...) or a local "
                             "diffusers folder with real weights (default: %(default)s)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPU count of the run; must equal the launched ranks (torchrun's WORLD_SIZE; default: it)")
    parser.add_argument("--prompts", default=str(PROMPTS),
                        help="file with one prompt per line ('#' comments skipped) (default: the package's bench/prompts.txt)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="measure only the first N prompts (default: all of them)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    parser.add_argument("--height", type=int, default=None, help="image/video height in pixels (default: the model's)")
    parser.add_argument("--width", type=int, default=None, help="image/video width in pixels (default: the model's)")
    parser.add_argument("--frames", type=int, default=None, help="video frames (default: the model's; images: 1)")
    parser.add_argument("--image", action="append", default=None, metavar="PATH",
                        help="input image of an edit or image-to-video model (repeatable, as generate's --image); "
                             "default for those models: a synthetic image of the run's size (conditioning.synthetic_"
                             "image), the shape a served edit has; text models take none")
    parser.add_argument("--mask", default=None, metavar="PATH",
                        help="mask of an inpainting model (FLUX.1 Fill); default: a synthetic one (right half)")
    parser.add_argument("--seed", type=int, default=0,
                        help="sampling seed of every generation (CPU generators, as generate and serve) (default: 0)")
    parser.add_argument("--weights-seed", type=int, default=0,
                        help="seed of a built-in model's random weights (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="warm-up generations per contender before timing (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=1,
                        help="denoising steps of a warm-up generation: every step runs the same kernels, so one step "
                             "warms up (and compiles) everything (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs of each prompt per round, back to back (the same prompt: the same shapes, "
                             "so a compiled contender compiles nothing new); every run is a sample, so a short call "
                             "measured once is not one garbage collection or clock change away from its median "
                             "(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure the eager diffusers and xstage contenders in N interleaved rounds (each round "
                             "applies, warms up, times every prompt and undoes each of them, in an order rotated "
                             "every round), so drift of the GPU over the run hits them all alike; the compiled "
                             "variants and the other stacks still run once. 1 = once each, with plain diffusers "
                             "repeated after the xstage contenders (default: %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="weights and activations; auto = bf16 on a GPU, fp32 on the CPU (default: auto)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where to run; auto = cuda when available (default: auto)")
    parser.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS),
                        help=f"comma-separated subset of {','.join(CONTENDERS + CACHE_CONTENDERS)} (default: all "
                             "but the FP8 ones, which need a GPU of compute capability >= 8.9, and the step caches "
                             "xstage-cache and cache-dit, a row per method and forced ratio each)")
    parser.add_argument("--compile", nargs="?", const="regional", default="off", metavar="{off,regional,full,graphs}",
                        help="also run each contender with torch.compile of the transformer (xstage_dit.features.compile): "
                             "regional = diffusers' compile_repeated_blocks (each repeated block compiled once; the "
                             "whole module where a model has none), full = torch.compile of the whole transformer, "
                             "graphs = full under CUDA graphs; "
                             "a bare --compile is regional; off reports the compiled variants as skipped "
                             "(default: %(default)s)")
    parser.add_argument("--compiled-only", action="store_true",
                        help="run only the torch.compile variants (with --compile): the eager rows are listed as "
                             "skipped, for a device call that has time for the compiled rows alone")
    parser.add_argument("--compile-also", default=None, metavar="MODE[,MODE]",
                        help="more torch.compile modes (full, graphs, regional) for the xstage contenders only, each "
                             "a variant named <contender>+compile:<mode> in the same run, after the --compile ones "
                             "(e.g. --compile regional --compile-also full,graphs; default: none)")
    parser.add_argument("--compile-guards", choices=GUARD_MODES, default="full",
                        help="the xstage contenders' compiled variants (the baselines compile as their users do): "
                             + GUARDS_HELP)
    parser.add_argument("--time-budget-s", type=float, default=0.0,
                        help="wall-clock budget of the whole run, model build included; a contender whose estimated "
                             "cost does not fit is reported 'skipped: time budget' (default: 0 = unlimited)")
    add_cfg_batch_option(parser, help_prefix="the xstage contenders: ")
    parser.add_argument("--compile-extra", default="", metavar="NAME[,NAME]",
                        help="the xstage contenders' compiled variants also compile (apply_compile's extras): "
                             "text-encoder = an LLM text encoder's language model whole, video-vae = a video VAE's "
                             "chunked decode; default: none")
    parser.add_argument("--compile-estimate-s", type=float, default=120.0,
                        help="compile time assumed by the budget check for a torch.compile variant (default: %(default)s)")
    parser.add_argument("--cache-contender-methods", default="fbcache,taylorseer,magcache,pab,fastercache",
                        metavar="METHOD[,METHOD]",
                        help="the step caches the xstage-cache contender runs, one row each per forced ratio "
                             "(default: %(default)s)")
    parser.add_argument("--cache-contender-every", default="4,2", metavar="N[,N]",
                        help="the forced ratios of the xstage-cache and cache-dit contenders: a full step every N "
                             "steps (4: 25 %% of the steps computed, 2: 50 %%; random weights make no trained residual "
                             "curve, so speed is measured at fixed ratios) (default: %(default)s)")
    add_cache_options(parser)  # --cache: the xstage contenders' engines run it (as generate and serve do)
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR,
                        help="where e2e-<model>-<gpus>x<gpu>.{json,md,png} go, relative to the current directory "
                             "(default: %(default)s)")
    parser.add_argument("--resume", metavar="PATH.json", default=None,
                        help="keep the measured rows of an earlier run of the same settings, commit and GPU (a "
                             "results JSON of this benchmark) and measure only the others: the rows of a long run "
                             "spread over several device calls on one machine, in one file (default: none)")
    parser.add_argument("--rerender", metavar="PATH.json", default=None,
                        help="measure nothing: recompute the comparisons, verdicts, summary and notes of a results "
                             "JSON written by this benchmark with the current code, and rewrite its .json/.md/.png "
                             "in place (the measured numbers stay as they are; the other options are ignored)")


def parse_contenders(text: str) -> list[str]:
    """The contender names of a comma-separated list, each once, in run order: the baseline first where named
    (the eager rows pair with it), the rest as given, so a time budget that runs out skips the last ones named (a
    fixed order had run xstage-served before the FP8 rows a call was for, and skipped those; H100, 2026-12-07).
    UsageError naming an unknown one."""
    names = list(dict.fromkeys(n.strip() for n in str(text).split(",") if n.strip()))
    known = CONTENDERS + CACHE_CONTENDERS
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise UsageError(f"expected --contenders from {','.join(known)}, got {text!r}")
    return [n for n in names if n == BASELINE] + [n for n in names if n != BASELINE]


def validate(args: argparse.Namespace) -> None:
    """Check option values before any model is built; UsageError names the bad value."""
    positive = {"--steps": args.steps, "--num-prompts": args.num_prompts, "--gpus": args.gpus,
                "--height": args.height, "--width": args.width, "--frames": args.frames,
                "--warmup-steps": args.warmup_steps, "--rounds": args.rounds, "--repeats": args.repeats}
    for flag, value in positive.items():
        if value is not None and value < 1:
            raise UsageError(f"expected {flag} >= 1, got {value}")
    if args.rerender is not None and not Path(args.rerender).is_file():
        raise UsageError(f"expected --rerender to be a results JSON written by xstage-dit bench, got {args.rerender!r}")
    if getattr(args, "resume", None) is not None:
        if not Path(args.resume).is_file():
            raise UsageError(f"expected --resume to be a results JSON written by xstage-dit bench, got {args.resume!r}")
        if args.rounds != 1:
            raise UsageError(f"expected --rounds 1 with --resume (rounds pair rows of one run), got {args.rounds}")
    if args.warmup < 0:
        raise UsageError(f"expected --warmup >= 0, got {args.warmup}")
    if not args.time_budget_s >= 0:
        raise UsageError(f"expected --time-budget-s >= 0 (0 = unlimited), got {args.time_budget_s}")
    if getattr(args, "compiled_only", False) and args.compile == "off":
        raise UsageError("expected --compile with --compiled-only (nothing would run), got --compile off")
    if args.compile not in COMPILE_MODES:
        raise UsageError(f"expected --compile in {', '.join(COMPILE_MODES)}, got {args.compile!r}")
    if compile_also_modes(args) and args.compile == "off":
        raise UsageError(f"expected --compile with --compile-also {args.compile_also!r}, got --compile off")
    try:
        parse_extras(args.compile_extra)
    except ValueError as exc:
        raise UsageError(f"--compile-extra: {exc}") from None
    if not args.compile_estimate_s >= 0:
        raise UsageError(f"expected --compile-estimate-s >= 0, got {args.compile_estimate_s}")
    for flag, path in [("--image", p) for p in args.image or ()] + [("--mask", args.mask)] * (args.mask is not None):
        if not Path(path).is_file():
            raise UsageError(f"expected {flag} to be an image file, got {path!r}")
    if not Path(args.prompts).is_file():
        raise UsageError(f"expected --prompts to be a file of prompts, got {args.prompts!r}")
    parse_contenders(args.contenders)
    cache_variants(args)
    cache_config(args)  # --cache and its parameters


def cache_variants(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(--cache-contender-methods, --cache-contender-every) as tuples; UsageError naming a bad value."""
    from xstage_dit.features.step_cache.config import METHODS

    text = str(getattr(args, "cache_contender_methods", "") or "")
    methods = tuple(m.strip() for m in text.split(",") if m.strip())
    if not methods or any(m not in METHODS for m in methods):
        raise UsageError(f"expected --cache-contender-methods from {','.join(METHODS)}, got {text!r}")
    text = str(getattr(args, "cache_contender_every", "") or "")
    try:
        every = tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        every = ()
    if not every or any(n < 1 for n in every):
        raise UsageError(f"expected --cache-contender-every as integers >= 1 (e.g. 4,2), got {text!r}")
    return methods, every


def compile_also_modes(args: argparse.Namespace) -> list[str]:
    """--compile-also as a list of modes, each named once and none of them "off" or --compile's own mode;
    UsageError naming the bad value."""
    modes = [m.strip() for m in (getattr(args, "compile_also", "") or "").split(",") if m.strip()]
    for mode in modes:
        if mode not in COMPILE_MODES or mode == "off":
            raise UsageError(f"expected --compile-also modes in {', '.join(m for m in COMPILE_MODES if m != 'off')}, "
                             f"got {mode!r}")
        if mode == args.compile:
            raise UsageError(f"expected --compile-also modes other than --compile's {args.compile!r}, got {mode!r}")
    if len(set(modes)) != len(modes):
        raise UsageError(f"expected each --compile-also mode once, got {args.compile_also!r}")
    return modes


def option_argv(args: argparse.Namespace) -> list[str]:
    """The options of this run as an argument list (what repeats it, and what each launched rank gets)."""
    argv = []
    for key, value in vars(args).items():
        if key in ("func", "command") or value is None or value is False:
            continue
        for one in value if isinstance(value, list) else [value]:  # a repeatable option: once per value
            argv += ["--" + key.replace("_", "-")] + ([] if one is True else [str(one)])
    return argv


def command_line(args: argparse.Namespace) -> str:
    """The options of this run as a command line (what to type to repeat it)."""
    return " ".join(["xstage-dit bench"] + [shlex.quote(a) for a in option_argv(args)])
