"""`xstage-dit generate`: one image (PNG) or video (MP4, or a PNG grid of frames) from a prompt, and for the
image-conditioned models input images: an edit (FLUX.1 Kontext, Qwen-Image-Edit, FLUX.2 references), inpainting
with a mask (FLUX.1 Fill) or image-to-video (Wan I2V, LTX-Video, CogVideoX).

Example::

    xstage-dit generate --model tiny-flux --prompt "a red fox in snow" --size 96x64 --output out/fox.png
    xstage-dit generate --model tiny-flux-kontext --image fox.png --prompt "make it night" --output out/night.png
    xstage-dit generate --model tiny-wan-i2v --image fox.png --prompt "the fox runs" --output out/fox.mp4
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_PROMPT = "a photo of a red fox sitting in the snow at sunrise, high quality"


def add_parser(subparsers) -> argparse.ArgumentParser:
    from xstage_dit.families import model_names

    p = subparsers.add_parser(
        "generate",
        help="generate an image or a video from a prompt",
        description="Generate an image (PNG) or a video (MP4, or a PNG grid of its frames) with a diffusers "
        "pipeline: a built-in model with random weights (no download) or a local diffusers folder. Options "
        "left out take the model's defaults.",
    )
    p.add_argument("--model", default="tiny-flux",
                   help=f"built-in model ({', '.join(model_names())}) or a local diffusers folder "
                   "(e.g. /path/to/FLUX.1-dev); default: %(default)s")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="text prompt (any language); default: %(default)r")
    p.add_argument("--negative-prompt", default=None,
                   help="negative prompt, for models that take one (Wan, NucleusMoE, HiDream)")
    p.add_argument("--height", type=int, default=None,
                   help="image height in pixels, a multiple of the model's patch size (16 for all built-in models)")
    p.add_argument("--width", type=int, default=None, help="image width in pixels, same rule as --height")
    p.add_argument("--size", default=None,
                   help="WIDTHxHEIGHT in pixels (e.g. 96x64), as the server's size; 'auto' or left out: the model's "
                        "default (an edit: its input image's size); instead of --width/--height")
    p.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="input image (PNG/JPEG/WebP) for an image edit or image-to-video model; repeat for a model "
                        "that takes several (FLUX.2, Qwen-Image-Edit Plus)")
    p.add_argument("--mask", default=None, metavar="PATH",
                   help="inpainting mask, the first image's size (FLUX.1 Fill): white (or, with an alpha channel, "
                        "transparent) = repaint")
    p.add_argument("--frames", type=int, default=None,
                   help="video frames (video models only): 1 + a multiple of 4 for Wan")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (>= 1)")
    p.add_argument("--guidance", type=float, default=None, help="guidance scale (>= 0)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the initial noise (a CPU generator, so the image does not depend on the device; "
                        "the server gives the same image for the same seed); default: %(default)s")
    p.add_argument("--weights-seed", type=int, default=0,
                   help="seed of the random weights of built-in models; default: %(default)s")
    p.add_argument("--output", "-o", default=None,
                   help="output file: .png/.jpg/.webp for images; .mp4 or an image suffix (a grid of frames) "
                   "for video; default: out/<model>-seed<seed>.png (or .mp4)")
    p.add_argument("--device", default="auto", help="torch device (cpu, cuda, cuda:1...); default: cuda if present")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights and compute dtype; auto = bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--no-progress", action="store_true", help="no progress bar over the denoising steps")
    # Parallelism (xstage_dit.parallelize): sp * cfg ranks; started here unless already under torchrun.
    p.add_argument("--sp", type=int, default=1, help="sequence-parallel (Ulysses) degree; default: %(default)s")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree for MoE models: 1 or --sp")
    p.add_argument("--cfg", type=int, default=1, help="CFG-parallel degree: 1 or 2 (cond/uncond on separate ranks)")
    from xstage_dit.features.config import add_cfg_batch_option

    add_cfg_batch_option(p)
    from xstage_dit.cli.compile_options import add_compile_option, add_warmup_sizes_option

    add_compile_option(p)
    add_warmup_sizes_option(p)
    from xstage_dit.cli.engine_options import add_feature_options, add_lora_options

    add_feature_options(p)
    add_lora_options(p, serve=False)
    p.set_defaults(func=run)
    return p


def _resolve_device_dtype(device_arg: str, dtype_arg: str):
    import torch

    from xstage_dit.cli import UsageError

    if device_arg == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(device_arg)
        except (RuntimeError, ValueError):
            raise UsageError(f"--device: expected cpu, cuda or cuda:N, got {device_arg!r}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"--device: expected a device present here, got {device_arg!r} (no CUDA GPU found)")
        if device.type not in ("cpu", "cuda"):
            raise UsageError(f"--device: expected cpu, cuda or cuda:N, got {device_arg!r}")
    if dtype_arg == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, dtype_arg)
    return device, dtype


def _parallel_setup(config):
    """None for one process; the exit code after starting sp*cfg ranks; RankInfo in a rank.

    config: the command's one ParallelConfig."""
    from xstage_dit.cli import UsageError

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if config.world_size == 1 and world == 1:
        return None
    if world == 1:  # not under torchrun: start the ranks ourselves and supervise them
        from xstage_dit.comm.launcher import launch

        return launch(config.world_size, [sys.executable, "-m", "xstage_dit", *sys.argv[1:]])
    if world != config.world_size:
        raise UsageError(f"--sp/--cfg: expected sp * cfg == {world} (the ranks started), got {config.world_size}")
    from xstage_dit.comm.distributed import init_distributed

    return init_distributed(timeout_s=config.timeout_s)


def _checked(args: argparse.Namespace):
    """Every value checked before anything is built, so a typo fails in milliseconds: (spec, parallel config,
    request, output path, warm-up sizes); UsageError naming the bad option."""
    from xstage_dit.cli import UsageError, parallel_config
    from xstage_dit.families import model_spec

    parallel = parallel_config(args)
    try:
        spec = model_spec(args.model)
    except ValueError as exc:
        raise UsageError(f"--model: {exc}") from None
    for flag, value in (("--steps", args.steps), ("--height", args.height), ("--width", args.width),
                        ("--frames", args.frames)):
        if value is not None and value < 1:
            raise UsageError(f"{flag}: expected a positive integer, got {value}")
    if args.guidance is not None and not args.guidance >= 0:
        raise UsageError(f"--guidance: expected a number >= 0, got {args.guidance}")
    _apply_size(args)
    if args.frames is not None and spec.kind == "image" and args.frames != 1:
        raise UsageError(f"--frames: expected no --frames for the image model {spec.name}, got {args.frames}")
    if not args.prompt.strip():
        raise UsageError(f"--prompt: expected a non-empty prompt, got {args.prompt!r}")
    from xstage_dit.cli.compile_options import check_compile_args, parse_warmup_sizes

    check_compile_args(args)
    from xstage_dit.cli.engine_options import check_cache, check_quantize

    check_quantize(args, None if args.device == "auto" else args.device)
    check_cache(args, spec, parallel, args.compile)
    warmup_sizes = parse_warmup_sizes(args.warmup_sizes, spec, sp=parallel.sp)
    from dataclasses import replace

    from xstage_dit.cli.engine_options import lora_options

    request = replace(_request(args, spec, parallel.sp), lora=lora_options(args)[1])
    output = _output_path(args, spec)
    from xstage_dit.cli.validate import check_parallel

    # Before any rank starts: what the model's config decides fails here once, in one line.
    check_parallel(spec, parallel, guidance=args.guidance)
    return spec, parallel, request, output, warmup_sizes


_SIZE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def _apply_size(args: argparse.Namespace) -> None:
    """--size WIDTHxHEIGHT into args.width / args.height ('auto': the model's default); UsageError naming it."""
    from xstage_dit.cli import UsageError

    if args.size is None or args.size.strip().lower() == "auto":
        return
    if args.width is not None or args.height is not None:
        raise UsageError(f"--size: expected either --size or --width/--height, got both ({args.size!r})")
    match = _SIZE.match(args.size)
    if not match or len(match.group(1)) > 6 or len(match.group(2)) > 6:
        raise UsageError(f"--size: expected 'WIDTHxHEIGHT' such as '96x64', got {args.size!r}")
    args.width, args.height = int(match.group(1)), int(match.group(2))


def _open_image(path: str, flag: str):
    """The image file at `path`, fully decoded (a truncated file fails here); UsageError naming `flag`."""
    from PIL import Image, UnidentifiedImageError

    from xstage_dit.cli import UsageError

    try:
        with Image.open(path) as image:
            image.load()
            return image.copy()
    except FileNotFoundError:
        raise UsageError(f"{flag}: expected an image file, got {path!r} (no such file)") from None
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise UsageError(f"{flag}: expected a PNG, JPEG or WebP image, got {path!r} ({exc})") from None


def _request(args: argparse.Namespace, spec, sp: int = 1):
    """The one `GenerationRequest` of the command line; UsageError naming the option a value came from."""
    from xstage_dit.cli import UsageError
    from xstage_dit.runtime.conditioning import ImageInputError
    from xstage_dit.runtime.generation import request_for

    images = [_open_image(path, "--image") for path in args.image or ()]
    mask = None if args.mask is None else _open_image(args.mask, "--mask")
    try:
        return request_for(spec, prompt=args.prompt, negative_prompt=args.negative_prompt, height=args.height,
                           width=args.width, frames=args.frames, steps=args.steps, guidance=args.guidance,
                           seed=args.seed, sp=sp, images=images, mask=mask)
    except ImageInputError as exc:
        raise UsageError(f"--{exc.param}: {exc.detail}") from None
    except ValueError as exc:
        text = str(exc)
        size = "--size" if args.size is not None else None
        flag = next((f for word, f in (("height", size or "--height"), ("width", size or "--width"),
                                       ("frames", "--frames"), ("seed", "--seed")) if word in text), "--model")
        raise UsageError(f"{flag}: {exc}") from None


def _output_path(args: argparse.Namespace, spec) -> Path:
    from xstage_dit.cli import UsageError
    from xstage_dit.runtime.generation import IMAGE_SUFFIXES, VIDEO_SUFFIXES

    default_suffix = ".mp4" if spec.kind == "video" else ".png"
    stem = Path(spec.name).name if spec.size == "local" else spec.name
    output = Path(args.output) if args.output else Path("out") / f"{stem}-seed{args.seed}{default_suffix}"
    allowed = IMAGE_SUFFIXES + (VIDEO_SUFFIXES if spec.kind == "video" else ())
    if output.suffix.lower() not in allowed:
        raise UsageError(f"--output: expected a file ending in one of {allowed}, got {str(output)!r}")
    return output


def _engine(args: argparse.Namespace, spec, parallel, device, dtype, rank: int):
    """The loaded pipeline under its feature stack, as the server runs it (batch invariance included: the same
    bytes for the same request): (engine, seconds to load)."""
    from xstage_dit.cli import UsageError
    from xstage_dit.cli.engine_options import compile_config, feature_switches, lora_options
    from xstage_dit.engine import Engine, EngineConfig

    try:
        config = EngineConfig(model=args.model, device=device, dtype=dtype, weights_seed=args.weights_seed,
                              parallel=parallel, compile=compile_config(args, device), **feature_switches(args),
                              **lora_options(args)[0])
    except ValueError as exc:
        raise UsageError(f"--lora: {exc}") from None
    engine = Engine(config, rank=rank)
    t0 = time.perf_counter()
    # With --ep N each rank creates or reads only its experts (its rank in the EP group, of N).
    try:
        pipe = engine.load()
    except ValueError as exc:
        if engine.expert_shard is None:
            raise
        raise UsageError(f"--ep: {exc}") from None  # no MoE layers, or ep not dividing the expert count
    t_build = time.perf_counter() - t0
    pipe.set_progress_bar_config(disable=args.no_progress or rank != 0, desc="denoising", file=sys.stderr,
                                 leave=False)
    # World 1 too: the measured attention kernel; MoE layers per kind (`choose_moe_world1`).
    from xstage_dit.features.lora import AdapterError

    try:
        engine.apply(pipe, kind=spec.kind)
    except AdapterError as exc:  # a preloaded --lora that cannot be served (a bad file, another model's adapter)
        raise UsageError(f"--lora: {exc}") from None
    except ValueError as exc:  # a degree this model cannot take (heads, MoE, CFG): one line, exit 2
        raise UsageError(f"--sp/--ep/--cfg: {exc}") from None
    return engine, t_build


def _warm_up(engine, spec, request, warmup_sizes) -> float:
    """One step at the request's size and at each warm-up size (compiling them) before the timed call, so
    "generating" is the compiled speed; returns the seconds it took (0 when compile is off and no size asked)."""
    from dataclasses import replace

    from xstage_dit.features.step_cache import cache_request
    from xstage_dit.runtime.generation import fixed_kwargs, pipeline_kwargs, run_pipeline

    if engine.config.compile.mode == "off" and not warmup_sizes:
        return 0.0
    t0 = time.perf_counter()
    for width, height in ((request.width, request.height),) + warmup_sizes:
        # Its own generators: the timed call's must start from the seed.
        warm = replace(request, width=width, height=height, steps=1)
        with cache_request(engine.pipe, steps=1):
            run_pipeline(engine.pipe, **pipeline_kwargs(engine.pipe, [warm], kind=spec.kind,
                                                        fixed=fixed_kwargs(spec), output_type="pt"))
    return time.perf_counter() - t0


def _report(engine, spec, result, output, kwargs, times: tuple[float, float, float], cache: dict | None) -> None:
    """rank 0: write the output, then what was made and how long it took."""
    from xstage_dit.runtime.generation import save_output, to_pil_frames

    t_gen, t_build, t_warm = times
    config = engine.config
    images = to_pil_frames(result, spec.kind)
    path = save_output(images, output, kind=spec.kind, fps=spec.fps)
    # The size actually made: HiDream, for one, keeps a fixed pixel area and only follows the aspect ratio.
    what = "x".join(map(str, images[0].size)) + (f", {len(images)} frames" if spec.kind == "video" else "")
    print(f"wrote {path.resolve()} ({spec.name}, {what}, {kwargs['num_inference_steps']} steps, {config.device}, "
          f"{str(config.dtype).removeprefix('torch.')})")
    shard = engine.expert_shard
    if shard is not None:
        held = [m for m in engine.pipe.transformer.modules() if getattr(m, "shard", None) == shard]
        print(f"experts: loaded sharded, each rank read only its {held[0].num_experts_per_rank} of "
              f"{held[0].num_experts} experts in {len(held)} MoE layers (ep={shard[1]})")
    if cache is not None:
        print(f"step cache {cache['method']}: {cache['computed']} {cache['unit']} computed, {cache['skipped']} skipped")
    warm = f", {t_warm:.2f} s warm-up ({engine.describe()['compile']['how']})" if t_warm else ""
    print(f"time: {t_gen:.2f} s generating, {t_build:.2f} s loading the pipeline{warm}, "
          f"{t_gen + t_build + t_warm:.2f} s total")
    if spec.weights_notice:
        print(f"note: {spec.weights_notice}")


def run(args: argparse.Namespace) -> int:
    # transformers warns at import about optional vision backends no pipeline here uses.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from xstage_dit.cli import UsageError

    spec, parallel, request, output, warmup_sizes = _checked(args)
    rank_info = _parallel_setup(parallel)  # may start the ranks and return their exit code
    if isinstance(rank_info, int):
        return rank_info
    device, dtype = _resolve_device_dtype(args.device, args.dtype)
    if rank_info is not None and device.type == "cuda" and args.device == "auto":
        device = rank_info.device  # one GPU per local rank (ranks share it where there are fewer)
    rank = 0 if rank_info is None else rank_info.rank
    engine, t_build = _engine(args, spec, parallel, device, dtype, rank)
    with engine:  # restored at the end: a caller in the same process gets the process back as it was
        from xstage_dit.runtime.generation import fixed_kwargs, pipeline_kwargs, run_pipeline

        try:
            kwargs = pipeline_kwargs(engine.pipe, [request], kind=spec.kind, fixed=fixed_kwargs(spec),
                                     output_type="pt")
        except ValueError as exc:  # an option this pipeline does not take (a negative prompt, ...)
            flag = "--negative-prompt" if "negative_prompt" in str(exc) else "--model"
            raise UsageError(f"{flag}: {exc}") from None
        if request.lora:
            from xstage_dit.features.lora import AdapterError

            try:
                engine.activate_loras(request.lora)
            except AdapterError as exc:
                raise UsageError(f"--lora: {exc}") from None
        t_warm = _warm_up(engine, spec, request, warmup_sizes)
        from xstage_dit.features.step_cache import cache_request

        t1 = time.perf_counter()
        with cache_request(engine.pipe, steps=request.steps) as cached:  # the cache's state is this call's own
            result = run_pipeline(engine.pipe, **kwargs)
        if device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)
        t_gen = time.perf_counter() - t1
        if rank == 0:  # only rank 0 writes the output
            _report(engine, spec, result, output, kwargs, (t_gen, t_build, t_warm), cached.stats)
    return 0
