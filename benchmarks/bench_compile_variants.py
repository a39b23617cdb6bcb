"""Which torch.compile setup makes a one-GPU transformer step (and the VAE decode) fastest: measured, not assumed.

Builds the full-size transformer of a model (random weights: time does not depend on values), applies
``parallelize`` at world 1 (the product's graph: its attention backend, serial schedule) and then each variant
in turn, restoring between them:

    eager                 no compile (diffusers' speed)
    regional / full       ``apply_compile(mode)``: diffusers' compile_repeated_blocks / the whole forward
    +tuned                Inductor's coordinate-descent tuning of its generated kernels, no epilogue fusion
    +gemmtuned            Inductor's GEMM autotuning (its Triton templates against ATen per shape, epilogues fused)
    +multikernel          Inductor's multi-kernel: wide row reductions (FP8's row-wise casts) also tried persistent
                          (``apply_compile(options=...)``, these graphs only)
    +qkv                  ``transformer.fuse_qkv_projections()`` first (one GEMM for q, k, v)
    +graphs               CUDA graphs (Inductor's ``triton.cudagraphs``, what ``mode="reduce-overhead"`` sets): the
                          compile xfuser's FLUX runner uses; one forward per step only (a CFG pipeline's second
                          forward would overwrite the first one's output)
    +fp8 / +fp8t / +fp8b / +fp8w  FP8 linear layers (issue 41): the stack's FP8 feature (`features.fp8.Fp8Handle`:
                          the family record's exclusions) row-wise, tensor-wise, block-wise or weight-only; with
                          @none the peers' recipe instead (torchao row-wise on every linear layer,
                          `bench.fp8_contenders.peer_fp8`)
    +fp8u                 row-wise FP8 without the fused activation quantization (`features.fp8_fused`): torchao's
                          layers quantize every input themselves, as before it
    +fp8x                 row-wise FP8 with grouped-GEMM experts left in bf16 (``Fp8Config(experts=False)``): what
                          NucleusMoE's grouped FP8 expert GEMM adds or costs
    +fp8attn              also the 8-bit attention kernels as candidates of the kernel sweep (needs @auto)
    +cudnnfp8             cuDNN's FP8 attention wherever it takes the shape, unswept (needs @auto; at world 1
                          compiled: its casts in the compiled blocks, ``ops.attention.fp8_traced``)
    @auto / @serial       the attention schedule ``parallelize`` is given (default serial: diffusers' own SDPA
                          call at world 1; auto: the machine's choice, e.g. FlashAttention-4 where it measured
                          faster than torch's SDPA)
    @none                 no ``parallelize`` at all: diffusers' own processors (what xfuser compiles at degree 1)

With ``--vae`` it also times the image VAE's decode of one latent: eager, channels_last, compiled, compiled +
channels_last. Every variant's output is compared with the eager one (max abs difference) before it is timed.
Each transformer row also records what its first call compiled: the Dynamo frames converted and torch.compile's
own timers by phase (`_torch_private.compile_seconds`), so a slow first call reads as many graphs or slow ones. A
variant that fails (after the first, every row's reference) leaves a row saying why, and the run goes on.
With ``--profile-first-call`` each first call also runs under cProfile (its time then includes the profiler's):
the row keeps its own time by package (Triton, Inductor, Dynamo, torchao, C functions, ...) and the costliest
functions, and ``first-call-<variant>.txt`` beside the results the full listing, to name what a slow first call
does outside torch.compile's timers (FP8's 110-130 s on the H100, fp8/NOTES.md).
With ``--profile-step`` each transformer variant also runs one warm call under torch's profiler: its kernel time by
kind (FP8 GEMMs, other GEMMs, attention, Inductor's fused kernels, other; `benchmarks/_step_profile.py`) goes into the
row with the median's part outside kernels (GPU idle: what CUDA graphs could win), and torch's table into
``step-<variant>.txt`` (``file_part``'s name): where an FP8 step's time goes beyond its GEMMs.

    python benchmarks/bench_compile_variants.py --model flux --variants eager,regional,full,regional+tuned --vae
    python benchmarks/bench_compile_variants.py --model flux --size tiny --device cpu --dtype float32 \\
        --height 64 --width 64 --variants eager,regional --backend eager          # the CPU smoke test
    python benchmarks/bench_compile_variants.py --model flux --variants \\
        regional,regional+fp8,regional+fp8t,regional+fp8@none,regional+fp8+fp8attn@auto   # FP8 per granularity

Writes <out-dir>/compile-variants-<model>.{json,md}: median of per-call CUDA-event timings after warm-up.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, when run as a script

from benchmarks._common import checked_list, environment, time_ms, write_results  # noqa: E402
from xstage_dit._torch_private import compile_seconds, compile_seconds_since, frames_converted  # noqa: E402

TUNED = {"coordinate_descent_tuning": True, "coordinate_descent_check_all_directions": True,
         "epilogue_fusion": False}
GRAPHS = {"triton.cudagraphs": True}
# Inductor's GEMM autotuning: times its Triton templates (persistent TMA ones on sm90, scaled FP8 included) against
# the ATen call per shape and keeps the fastest; a template also takes the pointwise consumers into its epilogue
GEMM_TUNED = {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"}
# Inductor's multi-kernel: a reduction up to 16x wider than its usual limit (1,024 along a row) gets a persistent
# variant (the row read once, in registers) beside the looped one, and the faster is kept at the first launch. FP8's
# row-wise casts reduce rows of 3,072 to 15,360 elements (FLUX's proj_out input: attention output and GELU(MLP) side
# by side), which Inductor loops over twice, or splits into an amax kernel and a cast kernel (the H100 profile at
# f54244c: 257 us a single block for that cast, against ~75 us for one pass at memory speed)
MULTI_KERNEL = {"triton.multi_kernel": 1}
# variant part -> the Inductor options it adds (none of them means anything without compile)
INDUCTOR_EXTRAS = {"tuned": TUNED, "gemmtuned": GEMM_TUNED, "multikernel": MULTI_KERNEL, "graphs": GRAPHS}
COLUMNS = ("what", "variant", "median_ms", "p20_ms", "p80_ms", "reps", "first_call_s", "frames", "compile_s",
           "speedup_vs_eager", "max_abs_diff_vs_eager", "note")
# variant part -> Fp8Config granularity
# NucleusMoE's text tokens in the e2e bench's call: "a red fox" in the pipeline's chat template, through the in-code
# tokenizer (176; CFG's "" pads to it in the batched pair). The image's 4096 tokens dominate the step.
NUCLEUS_TEXT = 176
FP8_EXTRAS = {"fp8": "row", "fp8u": "row", "fp8x": "row", "fp8t": "tensor", "fp8b": "block", "fp8w": "weight"}
# variant part -> Fp8Config attention
_FP8_ATTENTION = {"fp8attn": "auto", "cudnnfp8": "cudnn-fp8"}


@dataclass(frozen=True)
class Variant:
    """A parsed variant name: compile `mode`, its Inductor `options` (None: defaults), `qkv` fusion, the attention
    `schedule` ("none": no ``parallelize``), the `fp8` granularity (None: bf16) and `fp8_attention`."""

    mode: str
    options: dict | None = None
    qkv: bool = False
    schedule: str = "serial"
    fp8: str | None = None
    fp8_attention: str | None = None  # "auto" (+fp8attn) or a kernel by name (+cudnnfp8)
    fp8_fuse: bool = True  # +fp8u: row-wise without the fused activation quantization (Fp8Config.fuse_rows)
    fp8_experts: bool = True  # +fp8x: row-wise with the grouped-GEMM experts in bf16 (Fp8Config.experts)


def file_part(name: str) -> str:
    """A variant name as part of a file name: "regional+fp8+cudnnfp8@auto" -> "regional_fp8_cudnnfp8_auto" (the
    device machine sends back no file whose name holds "+" or "@")."""
    return name.replace("+", "_").replace("@", "_")


def parse_variant(name: str) -> Variant:
    """"regional+tuned+qkv@auto" -> Variant("regional", Inductor options, qkv=True, schedule="auto");
    "regional+fp8+fp8attn@auto" -> row-wise FP8 linear layers and 8-bit attention candidates. ValueError naming
    a bad name."""
    body, _, schedule = name.partition("@")
    mode, *extras = body.split("+")
    fp8 = [FP8_EXTRAS[e] for e in extras if e in FP8_EXTRAS]
    known = ("qkv", *INDUCTOR_EXTRAS, *_FP8_ATTENTION, *FP8_EXTRAS)
    attention = [_FP8_ATTENTION[e] for e in extras if e in _FP8_ATTENTION]
    if mode == "regional" and "graphs" in extras:
        # measured on an H100 (2026-12-07): the failure said so at the first block's second replay
        raise ValueError(f"expected graphs with full compile, got {name!r}: regionally compiled blocks of one class "
                         "share a CUDA graph whose output the next block's replay overwrites")
    if mode not in ("eager", "regional", "full") or any(e not in known for e in extras) or \
            schedule not in ("", "auto", "serial", "none") or \
            (mode == "eager" and any(e in extras for e in INDUCTOR_EXTRAS)) or \
            len(fp8) > 1 or len(attention) > 1 or (attention and (schedule != "auto" or fp8 in ([], ["weight"]))) or \
            (schedule == "none" and (fp8 not in ([], ["row"]) or "fp8u" in extras or "fp8x" in extras)):
        raise ValueError("expected a variant like eager, regional, full+tuned+qkv, full+graphs, eager@auto, "
                         "regional+fp8t, regional+fp8+fp8attn@auto (fp8attn or cudnnfp8: with fp8, fp8t or fp8b, at "
                         "@auto; at @none, "
                         f"the peers' recipe, FP8 is +fp8 only); got {name!r}")
    options = {k: v for extra, opts in INDUCTOR_EXTRAS.items() if extra in extras for k, v in opts.items()}
    return Variant(mode, options or None, "qkv" in extras, schedule or "serial", fp8[0] if fp8 else None,
                   attention[0] if attention else None, "fp8u" not in extras, "fp8x" not in extras)


_PACKAGES = ("triton", "torch/_inductor", "torch/_dynamo", "torch/_functorch", "torchao", "diffusers", "xstage_dit",
             "torch")  # the first that a function's file path contains names its package (torch last: the rest)


def _package(filename: str) -> str:
    if filename == "~":
        return "C functions"  # built-ins: torch's C++ ops, CUDA calls, ...
    return next((p.replace("/", ".") for p in _PACKAGES if f"/{p}/" in filename), "other")


def profiled_call(fn, listing: Path | None = None, top: int = 12):
    """Runs ``fn()`` under cProfile -> (its result, {"by_package_s": own seconds per package, "top_cumulative":
    [[function, cumulative s], ...]}); writes the full pstats listing (cumulative, then own time) to `listing`."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    result = profile.runcall(fn)
    stats = pstats.Stats(profile)
    by_package: dict[str, float] = {}
    for (filename, _line, _name), (_cc, _nc, own, _cum, _callers) in stats.stats.items():
        package = _package(filename)
        by_package[package] = by_package.get(package, 0.0) + own
    ranked = sorted(stats.stats.items(), key=lambda item: item[1][3], reverse=True)
    summary = {"by_package_s": {k: round(v, 3) for k, v in sorted(by_package.items(), key=lambda kv: -kv[1])},
               "top_cumulative": [[pstats.func_std_string(func), round(row[3], 3)] for func, row in ranked[:top]]}
    if listing is not None:
        text = io.StringIO()
        for order in ("cumulative", "tottime"):
            pstats.Stats(profile, stream=text).sort_stats(order).print_stats(40)
        listing.write_text(text.getvalue())
    return result, summary


def _apply_fp8(transformer, handle, variant: Variant):
    """FP8 of `variant` on `transformer` (after ``parallelize``'s `handle`, before compile); returns the undo."""
    if variant.schedule == "none":  # the peers' recipe, row-wise (`parse_variant` refuses another granularity)
        from xstage_dit.bench.fp8_contenders import peer_fp8

        return peer_fp8(transformer)
    from xstage_dit.features.fp8 import Fp8Config, Fp8Handle, require_fp8_device

    require_fp8_device(next(transformer.parameters()).device, variant.fp8)
    attention_undo = (handle.attention_kernels.use_fp8_attention(variant.fp8_attention) if variant.fp8_attention
                      else None)
    fp8 = Fp8Handle(transformer, Fp8Config(variant.fp8, fuse_rows=variant.fp8_fuse, experts=variant.fp8_experts))

    def undo() -> None:
        fp8.restore()
        if attention_undo is not None:
            attention_undo()

    return undo


def _transformer_and_inputs(model: str, size: str, *, height: int, width: int, frames: int, dtype, device):
    if model == "flux":
        from xstage_dit.families.flux import build_transformer
        from xstage_dit.families.flux_inputs import transformer_inputs

        t = build_transformer(size, dtype=dtype, device=device)
        return t, transformer_inputs(t.config, height=height, width=width, text_tokens=512, dtype=dtype,
                                     device=device, seed=0)
    if model == "nucleusmoe":
        return _nucleusmoe_and_inputs(size, height=height, width=width, dtype=dtype, device=device)
    from xstage_dit.families.wan import build_transformer

    t = build_transformer(size, dtype=dtype, device=device)
    cfg = t.config
    gen = torch.Generator(device="cpu").manual_seed(0)
    latent_frames = (frames - 1) // 4 + 1
    hidden = torch.randn((1, cfg.in_channels, latent_frames, height // 8, width // 8), generator=gen)
    text = torch.randn((1, 512, cfg.text_dim), generator=gen)
    return t, {"hidden_states": hidden.to(device, dtype), "encoder_hidden_states": text.to(device, dtype),
               "timestep": torch.tensor([500], device=device)}


def _nucleusmoe_and_inputs(size: str, *, height: int, width: int, dtype, device, text_tokens: int = NUCLEUS_TEXT):
    """NucleusMoE's transformer and one forward's inputs as the served call makes them: CFG's two passes as one
    batch of 2 (``--cfg-batch auto``, the default), latents packed 2 x 2 ((height/16) * (width/16) tokens), the
    text's hidden states of `text_tokens` tokens, every one attended."""
    from xstage_dit.families.nucleusmoe import build_transformer

    t = build_transformer(size, dtype=dtype, device=device)
    cfg = t.config
    gen = torch.Generator(device="cpu").manual_seed(0)
    h, w = height // 16, width // 16
    hidden = torch.randn((2, h * w, cfg.in_channels), generator=gen)
    text = torch.randn((2, text_tokens, cfg.joint_attention_dim), generator=gen)
    return t, {"hidden_states": hidden.to(device, dtype), "img_shapes": [(1, h, w)] * 2,
               "encoder_hidden_states": text.to(device, dtype),
               "encoder_hidden_states_mask": torch.ones(2, text_tokens, dtype=torch.bool, device=device),
               "timestep": torch.tensor([0.5, 0.5], device=device, dtype=dtype)}


def measure_transformer(args, variants: list[str], device, dtype, rows: list[dict], save) -> list[dict]:
    """Appends one row per variant to ``rows`` and calls ``save()`` after each (a run cut short keeps them)."""
    from xstage_dit.features import ParallelConfig, parallelize
    from xstage_dit.features.compile import apply_compile

    transformer, inputs = _transformer_and_inputs(args.model, args.size, height=args.height, width=args.width,
                                                  frames=args.frames, dtype=dtype, device=device)

    @torch.inference_mode()
    def step():
        return transformer(**inputs, return_dict=False)[0]

    reference, eager_ms = None, None
    try:
        for name in variants:
            v = parse_variant(name)
            handle = None if v.schedule == "none" else parallelize(
                transformer, ParallelConfig(schedule=v.schedule, calibrate=v.schedule == "auto"))
            fp8_undo = compiled = None
            try:
                if v.qkv:
                    transformer.fuse_qkv_projections()
                if v.fp8 is not None:
                    fp8_undo = _apply_fp8(transformer, handle, v)
                compiled = None if v.mode == "eager" else apply_compile(
                    _Pipe(transformer), v.mode, backend=args.backend, options=v.options)
                frames0, compiled0 = frames_converted(), compile_seconds()

                def first_call():
                    out = step()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    return out

                t0 = time.perf_counter()
                if args.profile_first_call:
                    listing = Path(args.out_dir) / f"first-call-{file_part(name)}.txt"
                    listing.parent.mkdir(parents=True, exist_ok=True)
                    out, profile = profiled_call(first_call, listing)
                else:
                    out, profile = first_call(), None
                first_s = time.perf_counter() - t0
                phases = compile_seconds_since(compiled0)
                if not torch.isfinite(out).all():
                    raise RuntimeError(f"variant {name}: expected a finite output, got NaN/inf")
                if reference is None:
                    reference = out.float().clone()
                diff = float((out.float() - reference).abs().max())
                stats = time_ms(step, warmup=args.warmup, reps=args.reps, device=device)
                if v == Variant("eager") and eager_ms is None:
                    eager_ms = stats["median_ms"]
                choices = getattr(handle, "schedule_choices", None)
                step_profile = _profile_step(step, device, Path(args.out_dir) / f"step-{file_part(name)}.txt",
                                             stats["median_ms"]) if args.profile_step else None
                note = "; ".join(x for x in (compiled.how if compiled else "",
                                             f"schedules {choices}" if v.schedule == "auto" else "",
                                             step_profile and f"kernel ms by kind {step_profile['by_kind_ms']}, "
                                             f"outside kernels {step_profile['outside_kernels_ms']}, "
                                             f"host {step_profile['host_ms']}") if x)
                rows.append(dict(what=f"{args.size}-{args.model} transformer step", variant=name, **stats,
                                 first_call_s=round(first_s, 2), frames=frames_converted() - frames0,
                                 compile_s=phases["total"], compile_phases=phases,  # the phases: JSON only
                                 speedup_vs_eager=round(eager_ms / stats["median_ms"], 4) if eager_ms else None,
                                 max_abs_diff_vs_eager=diff, note=note,
                                 **({"first_call_profile": profile} if profile else {}),  # JSON only
                                 **({"step_profile": step_profile} if step_profile else {})))
                if profile:
                    print(f"{name:24s} first call by package (s, own time): {profile['by_package_s']}", flush=True)
                print(f"{name:24s} {stats['median_ms']:9.3f} ms (p20 {stats['p20_ms']:.3f}, p80 {stats['p80_ms']:.3f}) "
                      f"first call {first_s:.1f} s ({rows[-1]['frames']} frames, compile {phases}), "
                      f"max|diff| {diff:.3g}", flush=True)
                save()
            except Exception as exc:  # one variant's failure (a kernel a GPU lacks) costs its row, not the call's
                if reference is None:
                    raise  # the first variant is every other row's reference
                rows.append(dict(what=f"{args.size}-{args.model} transformer step", variant=name,
                                 note=f"failed: {type(exc).__name__}: {exc}"[:300]))
                print(f"{name:24s} failed: {type(exc).__name__}: {exc}", flush=True)
                save()
            finally:
                if compiled is not None:
                    compiled.restore()
                if fp8_undo is not None:
                    fp8_undo()
                if v.qkv:
                    transformer.unfuse_qkv_projections()
                if handle is not None:
                    handle.restore()
    finally:
        del transformer, inputs
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _profile_step(step, device, listing: Path, step_ms: float) -> dict:
    """One warm call of ``step`` under torch's profiler: its kernel time by kind (`_step_profile.step_breakdown`)
    and ``outside_kernels_ms``, the timed median ``step_ms`` less the kernels' sum (the GPU idle between launches,
    what CUDA graphs could win; the profiler's own overhead is not in the median), printed; torch's table written
    to `listing`."""
    from benchmarks._step_profile import step_breakdown

    summary, table = step_breakdown(step, device)
    summary["outside_kernels_ms"] = round(step_ms - summary["total_ms"], 3)
    listing.parent.mkdir(parents=True, exist_ok=True)
    listing.write_text(table)
    print(f"  kernel ms by kind (of {summary['total_ms']}, step {step_ms:.3f}): {summary['by_kind_ms']}", flush=True)
    return summary


class _Pipe:
    """What ``apply_compile`` compiles: an object with a ``.transformer``."""

    def __init__(self, transformer):
        self.transformer = transformer


def measure_vae(args, device, dtype, rows: list[dict], save) -> list[dict]:
    from diffusers import AutoencoderKL

    from xstage_dit.families.build import build_module
    from xstage_dit.families.flux import VAE

    vae = build_module(lambda: AutoencoderKL(**VAE[args.size]), seed=3, device=device, dtype=dtype)
    gen = torch.Generator(device="cpu").manual_seed(0)
    latents = torch.randn((1, vae.config.latent_channels, args.height // 8, args.width // 8), generator=gen)
    latents = latents.to(device, dtype)
    reference, eager_ms = None, None
    for name in args.vae_variants:
        channels_last = "channels_last" in name
        vae.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        # cudnn_benchmark: cuDNN times its conv algorithms once per shape (a server decodes few shapes)
        torch.backends.cudnn.benchmark = "cudnn_benchmark" in name
        if "compiled_decoder" in name:
            # the decoder module alone: compiling vae.decode traced diffusers' lru_cache'd version checks
            decoder = vae.decoder
            vae.decoder = torch.compile(decoder, dynamic=False, backend=args.backend)
        compiled_decode = "compiled+" in name or name == "compiled"
        decode = torch.compile(vae.decode, dynamic=False, backend=args.backend) if compiled_decode else vae.decode

        @torch.inference_mode()
        def call(decode=decode):
            return decode(latents, return_dict=False)[0]

        t0 = time.perf_counter()
        out = call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        first_s = time.perf_counter() - t0
        if reference is None:
            reference = out.float().clone()
        diff = float((out.float() - reference).abs().max())
        stats = time_ms(call, warmup=args.warmup, reps=args.reps, device=device)
        eager_ms = eager_ms or stats["median_ms"]
        rows.append(dict(what=f"{args.size}-flux VAE decode {args.width}x{args.height}", variant=name, **stats,
                         first_call_s=round(first_s, 2), speedup_vs_eager=round(eager_ms / stats["median_ms"], 4),
                         max_abs_diff_vs_eager=diff, note=""))
        print(f"vae {name:22s} {stats['median_ms']:9.3f} ms first call {first_s:.1f} s, max|diff| {diff:.3g}",
              flush=True)
        save()
        if "compiled_decoder" in name:
            vae.decoder = decoder
        torch._dynamo.reset()
    torch.backends.cudnn.benchmark = False
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="flux", choices=("flux", "wan", "nucleusmoe"))
    p.add_argument("--size", default="full", choices=("tiny", "full"))
    p.add_argument("--variants", default="eager,regional,full,regional+tuned,regional+qkv,full+tuned")
    p.add_argument("--vae", action="store_true", help="also time the FLUX VAE decode variants")
    p.add_argument("--vae-variants", default="eager,channels_last,compiled,compiled+channels_last",
                   help="with --vae: any of eager, channels_last, compiled, compiled+channels_last, cudnn_benchmark, "
                        "channels_last+cudnn_benchmark, compiled_decoder, compiled_decoder+cudnn_benchmark")
    p.add_argument("--height", type=int, default=None, help="default: 1024 (flux, nucleusmoe), 480 (wan)")
    p.add_argument("--width", type=int, default=None, help="default: 1024 (flux, nucleusmoe), 832 (wan)")
    p.add_argument("--frames", type=int, default=81, help="wan: video frames (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (the CPU smoke test: eager)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--out-dir", default="benchmarks/results/compile")
    p.add_argument("--profile-first-call", action="store_true",
                   help="run each transformer variant's first call under cProfile (module docstring)")
    p.add_argument("--profile-step", action="store_true",
                   help="after timing, one warm call of each transformer variant under torch's profiler: its "
                        "kernel time by kind (FP8 GEMMs, other GEMMs, attention, Inductor's fused kernels) in the "
                        "row, torch's table in step-<variant>.txt")
    args = p.parse_args(argv)
    variants = checked_list(p, args.variants, parse_variant)
    args.vae_variants = [v.strip() for v in args.vae_variants.split(",") if v.strip()]
    vae_known = {"eager", "channels_last", "compiled", "compiled+channels_last", "cudnn_benchmark",
                 "channels_last+cudnn_benchmark", "compiled_decoder", "compiled_decoder+cudnn_benchmark"}
    if set(args.vae_variants) - vae_known:
        p.error(f"expected --vae-variants from {sorted(vae_known)}, got {sorted(set(args.vae_variants) - vae_known)}")
    args.height = args.height or (480 if args.model == "wan" else 1024)
    args.width = args.width or (832 if args.model == "wan" else 1024)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    env = environment()
    out = Path(args.out_dir) / f"compile-variants-{args.model}"
    notes = (f"Median of per-call CUDA-event timings after {args.warmup} warm-up calls ({args.reps} reps), one "
             "process, variants in the order listed; first_call_s includes the compile. Tuned = Inductor options "
             f"{TUNED}.")
    rows: list[dict] = []

    def save():
        steps = [r for r in rows if "transformer" in r["what"] and "median_ms" in r]  # a failed variant has none
        best = min(steps, key=lambda r: r["median_ms"]) if steps else None
        summary = {"model": args.model, "size": args.size, "resolution": f"{args.width}x{args.height}",
                   "dtype": args.dtype, "fastest_transformer_variant": best and best["variant"],
                   "fastest_transformer_ms": best and best["median_ms"]}
        return write_results(out, "compile-variants", rows, summary, COLUMNS, notes=notes, env=env)

    if variants:  # --variants '' with --vae: the VAE rows alone
        measure_transformer(args, variants, device, dtype, rows, save)
    if args.vae:
        measure_vae(args, device, dtype, rows, save)
    json_path, md_path = save()
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
