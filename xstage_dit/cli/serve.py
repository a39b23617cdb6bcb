"""`xstage-dit serve`: the generation server (FastAPI under uvicorn) over `sp * cfg` ranks.

Example::

    xstage-dit serve --model tiny-flux --port 8000
    curl -s localhost:8000/v1/images/generations -H 'content-type: application/json' \\
         -d '{"prompt": "a red fox", "size": "64x64", "seed": 1}'

With `--sp 2` (or `--cfg 2`) the command starts the ranks itself (one process per rank, like torchrun),
or runs as one rank when started by `torchrun --nproc-per-node N -m xstage_dit serve ...`. Rank 0 runs
the HTTP server; every request runs on all ranks.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

# The defaults of the limits are ServerConfig's own (xstage_dit/server/config.py imports only the standard library).
from xstage_dit.features.config import add_cfg_batch_option
from xstage_dit.server.config import VIDEO_STREAM_POLICIES, ServerConfig as _D

DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="serve image/video generation over HTTP (OpenAI-style API, web page at /)",
        description="Serve a diffusers pipeline over HTTP on sp*cfg ranks: POST /v1/images/generations, "
        "POST /v1/videos (jobs), per-step progress as server-sent events, /health, /metrics (Prometheus), "
        "/v1/models, /v1/calibration, OpenAPI docs at /docs and a web page at /. Set $XSTAGE_API_KEY to "
        "require 'Authorization: Bearer <key>' on /v1/*.")
    p.add_argument("--model", default="tiny-flux",
                   help="built-in model name (random weights) or a local diffusers folder; default: %(default)s")
    p.add_argument("--sp", type=int, default=1, help="sequence-parallel (Ulysses) degree; default: %(default)s")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree, 1 or equal to --sp; default: %(default)s")
    p.add_argument("--cfg", type=int, default=1, help="CFG-parallel degree, 1 or 2; default: %(default)s")
    add_cfg_batch_option(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; default: %(default)s")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; default: %(default)s")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto = bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--weights-seed", type=int, default=0,
                   help="seed of a built-in model's random weights (images take the seed of their request); "
                        "default: %(default)s")
    p.add_argument("--max-queue", type=int, default=_D.max_queue, help="waiting jobs before 429; default: %(default)s")
    p.add_argument("--max-batch-size", type=int, default=_D.max_batch_size,
                   help="images per pipeline call when requests are compatible; default: %(default)s")
    p.add_argument("--batch-wait-ms", type=float, default=_D.batch_wait_s * 1000,
                   help="wait for compatible requests before a batch starts; default: %(default)s")
    p.add_argument("--request-timeout", type=float, default=_D.request_timeout_s,
                   help="seconds from submission until a job fails with 504; default: %(default)s")
    p.add_argument("--max-steps", type=int, default=_D.max_steps, help="largest num_inference_steps; default: %(default)s")
    p.add_argument("--max-n", type=int, default=_D.max_n, help="largest n (images per request); default: %(default)s")
    p.add_argument("--max-size", type=int, default=_D.max_size, help="largest width or height; default: %(default)s")
    p.add_argument("--max-frames", type=int, default=_D.max_frames, help="largest video frame count; default: %(default)s")
    p.add_argument("--max-body-bytes", type=int, default=_D.max_body_bytes, help="largest request body; default: %(default)s")
    p.add_argument("--max-upload-bytes", type=int, default=_D.max_upload_bytes,
                   help="largest body of the endpoints taking images (/v1/images/edits, /v1/videos); default: "
                        "%(default)s")
    p.add_argument("--max-image-pixels", type=int, default=_D.max_image_pixels,
                   help="largest input image (width x height, read from its header before decoding: decompression "
                        "bombs are refused); default: %(default)s")
    p.add_argument("--heartbeat-timeout", type=float, default=_D.heartbeat_timeout_s,
                   help="seconds without a heartbeat before a rank counts as dead; default: %(default)s")
    p.add_argument("--exit-after-failure", type=float, default=_D.exit_after_failure_s,
                   help="after a rank failure, answer 503 this long, then exit non-zero; default: %(default)s")
    p.add_argument("--collective-timeout", type=float, default=600.0,
                   help="timeout of torch.distributed collectives, seconds; default: %(default)s")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the one-step warm-up at the model's default size before reporting ready")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave the heap alive after warm-up to Python's garbage collector (by default it is frozen "
                        "out of its way: a full collection of a loaded pipeline pauses every thread for a few "
                        "hundred ms)")
    p.add_argument("--no-keep-freed-memory", action="store_true",
                   help="leave glibc's malloc thresholds as they are (by default, from before warm-up, freed blocks under "
                        "32 MiB stay mapped so each answer's image buffers do not page-fault: "
                        "xstage_dit.runtime.malloc_heap)")
    p.add_argument("--video-stream", choices=VIDEO_STREAM_POLICIES, default=_D.video_stream,
                   help="encode a video's MP4 while its VAE decodes: where the pipeline runs on a GPU (gpu), "
                        "always, or never (encode after the call); default: %(default)s")
    from xstage_dit.cli.compile_options import add_compile_option, add_warmup_sizes_option

    add_compile_option(p)
    add_warmup_sizes_option(p)
    from xstage_dit.cli.engine_options import add_feature_options, add_lora_options

    add_feature_options(p)
    add_lora_options(p, serve=True)
    from xstage_dit.cli.serve_replicas import add_options as add_replica_options

    add_replica_options(p)
    p.add_argument("--batching", default=_D.batching, choices=("auto", "always", "never"),
                   help="auto = batch a size only where warm-up measured a batch at >= 1 + --batch-margin times "
                        "the images/s of single images, with bit-identical images (else first come, first served); "
                        "always = batch every compatible request; never = FIFO; default: %(default)s")
    p.add_argument("--batch-margin", type=float, default=_D.batch_margin,
                   help="images/s gain a batch must show for --batching auto (0.1 = 10 %%); default: %(default)s")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)
    return p


def _config(args: argparse.Namespace):
    """The command's ServerConfig, carrying its one ParallelConfig; UsageError naming a bad option."""
    from xstage_dit.cli import UsageError, parallel_config
    from xstage_dit.server.config import ServerConfig

    parallel = parallel_config(args, timeout_flag="--collective-timeout")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port: expected 0..65535, got {args.port}")
    try:
        from xstage_dit.families import model_spec

        spec = model_spec(args.model)
    except ValueError as exc:
        raise UsageError(f"--model: {exc}") from None
    from xstage_dit.cli.validate import check_parallel

    check_parallel(spec, parallel)  # before any rank starts
    from xstage_dit.cli.compile_options import check_compile_args, parse_warmup_sizes

    check_compile_args(args)
    from xstage_dit.cli.engine_options import check_cache, check_quantize

    check_quantize(args)
    check_cache(args, spec, parallel, args.compile)
    warmup_sizes = parse_warmup_sizes(args.warmup_sizes, spec, sp=parallel.sp)
    _check_lora(args)
    try:
        return ServerConfig(
            max_queue=args.max_queue, max_batch_size=args.max_batch_size, batch_wait_s=args.batch_wait_ms / 1000,
            request_timeout_s=args.request_timeout, max_body_bytes=args.max_body_bytes, max_n=args.max_n,
            max_upload_bytes=args.max_upload_bytes, max_image_pixels=args.max_image_pixels,
            max_steps=args.max_steps, max_size=args.max_size, max_pixels=args.max_size * args.max_size,
            max_frames=args.max_frames, heartbeat_timeout_s=args.heartbeat_timeout,
            exit_after_failure_s=args.exit_after_failure, warmup=not args.no_warmup, parallel=parallel,
            gc_freeze=not args.no_gc_freeze, keep_freed_memory=not args.no_keep_freed_memory,
            video_stream=args.video_stream, warmup_sizes=warmup_sizes, batching=args.batching,
            batch_margin=args.batch_margin)
    except ValueError as exc:
        option = str(exc).split(":")[0].replace("_", "-")
        raise UsageError(f"--{option}: {str(exc).split(':', 1)[1].strip()}") from None


def _check_lora(args: argparse.Namespace) -> None:
    """The LoRA options as the engine will take them (before any rank starts); UsageError naming the bad one."""
    from xstage_dit.cli import UsageError
    from xstage_dit.cli.engine_options import lora_options
    from xstage_dit.features.lora import LoraServingConfig

    fields, _ = lora_options(args)
    if not fields:
        return
    try:
        LoraServingConfig(lora_dir=fields["lora_dir"], max_loras=fields["max_loras"],
                          max_lora_rank=fields["max_lora_rank"], max_per_request=fields["max_loras_per_request"],
                          preload=tuple(p for p in fields["preload_loras"] if os.sep not in p),
                          mode=fields["lora_mode"])
    except ValueError as exc:
        option = {"lora_dir": "--lora-dir", "preloaded": "--preload-loras", "max_per_request":
                  "--max-loras-per-request", "max_lora_rank": "--max-lora-rank", "lora mode": "--lora-mode"}
        flag = next((f for word, f in option.items() if word in str(exc)), "--max-loras")
        raise UsageError(f"{flag}: {exc}") from None


def _argv(args: argparse.Namespace) -> list[str]:
    """The same command line, for the rank processes."""
    out = ["serve"]
    for action in add_parser(argparse.ArgumentParser().add_subparsers())._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest)
        if value is None:  # an option left to its default (e.g. --compile: chosen by the device)
            continue
        if action.nargs == 0:  # a flag
            out += [action.option_strings[0]] if value else []
        else:
            out += [action.option_strings[0], str(value)]
    return out


def run(args: argparse.Namespace) -> int:
    # transformers warns at import about optional vision backends no pipeline here uses.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    config = _config(args)
    from xstage_dit.cli import serve_replicas

    if serve_replicas.wanted(args):  # replicas of the engine on Ray Serve (xstage_dit.deploy)
        return serve_replicas.run(args, config)
    world_size = config.parallel.world_size
    started_as_rank = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if world_size > 1 and not started_as_rank:
        from xstage_dit.comm.launcher import launch

        # Rank 0 decides: it must stay up to answer 503 and report another rank's failure.
        return launch(world_size, [sys.executable, "-m", "xstage_dit", *_argv(args)], policy="leader", poll_s=0.2,
                      label="xstage-dit serve")
    if started_as_rank and int(os.environ["WORLD_SIZE"]) != world_size:
        from xstage_dit.cli import UsageError

        raise UsageError(f"--sp/--cfg: expected sp*cfg == WORLD_SIZE ({os.environ['WORLD_SIZE']}), got {world_size}")
    return serve_rank(args, config)


def serve_rank(args: argparse.Namespace, config) -> int:
    """One rank: rank 0 runs uvicorn and the worker thread; the others run the follower loop."""
    import torch

    from xstage_dit.server.startup import model_loader
    from xstage_dit.server.ranks import RankContext
    from xstage_dit.server.worker import READY, STOPPED, Worker

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not torch.cuda.is_available():
        # CPU ranks share the cores: without this each would start one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    from xstage_dit.cli.compile_options import compile_extras
    from xstage_dit.cli.engine_options import feature_switches, lora_options

    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    loader = model_loader(args.model, config.parallel, dtype=dtype, weights_seed=args.weights_seed,
                          compile=args.compile, max_compiled_shapes=args.max_compiled_shapes,
                          compile_guards=args.compile_guards, compile_extras=compile_extras(args),
                          features=feature_switches(args), lora=lora_options(args)[0])

    def join() -> RankContext:
        return RankContext.join(config.parallel.timeout_s)

    if rank != 0:
        try:
            code = Worker(loader, config, join=join).run_follower()
        except Exception as exc:  # noqa: BLE001 - rank 0 gone or the ranks disagree: one line, non-zero exit
            logging.getLogger("xstage_dit.serve").error("rank %d stopping: %s", rank, str(exc).splitlines()[0])
            code = 1
        sys.stderr.flush()
        os._exit(code)  # daemon threads may sit in a collective; nothing left to clean up

    import uvicorn

    from xstage_dit.server.app import create_app

    holder: dict = {}

    def on_fatal(reason: str) -> None:
        server = holder.get("server")
        if server is not None:
            server.should_exit = True

    worker = Worker(loader, config, join=join, on_fatal=on_fatal)
    app = create_app(worker)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    holder["server"] = server

    def announce() -> None:
        if worker.wait_ready(timeout_s=config.parallel.timeout_s * 2):
            from xstage_dit.server.announce import ready_lines

            for line in ready_lines(worker.served, f"http://{args.host}:{args.port}", worker.ctx.world_size,
                                    needs_key=config.api_key is not None):
                print(line, file=sys.stderr, flush=True)

    import threading

    # uvicorn re-raises the signal that stopped it once it has shut down; with a handler in place that
    # signal is harmless and the worker can still tell the other ranks to stop.
    import signal

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: None)
    worker.start()
    threading.Thread(target=announce, daemon=True).start()
    server.run()
    worker.stop()
    code = 0 if worker.state in (READY, STOPPED) else 1
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)
