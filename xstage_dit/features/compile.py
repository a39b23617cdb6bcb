"""`apply_compile(pipe, mode)`: torch.compile of a pipeline's transformer with a bound on recompiles.

Modes:

- ``off``: nothing (the default on a CPU, where Inductor's compile time is never paid back).
- ``regional``: diffusers' ``compile_repeated_blocks`` where the transformer names repeated blocks (each
  block class compiled once and reused by every layer: a fraction of the full compile time, the same
  speed); the whole transformer where it has none. The default on a GPU.
- ``full``: ``torch.compile`` of the whole transformer forward.
- ``graphs``: ``full`` under CUDA graphs (Inductor's ``triton.cudagraphs``, what ``mode="reduce-overhead"``
  sets: each compiled shape replays one recorded graph, no kernel launches from the host). xfuser's FLUX runner
  compiles this way. Each call starts a new graph generation (``torch.compiler.cudagraph_mark_step_begin``) and
  its tensor outputs are cloned out of the graph's memory pool, so a pipeline that keeps one forward's output
  across the next (CFG's two forwards a step) reads its own values. Costs the memory of one forward's
  activations per compiled shape. Measured against full and regional:
  ``benchmarks/results/e2e/nucleusmoe-compilemodes-1xh200-b3a1445.md``.

Every compiling mode also compiles the image VAE's decoder (``AutoencoderKL``, as FLUX, SD3 and QwenImage
use; never under CUDA graphs), one graph per decoded size under the same bound (compiled against eager, and
the compile time: ``benchmarks/results/compile/``). A video VAE (Qwen-Image's, NucleusMoE's,
Wan's) decoding a one-frame latent is compiled too where `parallelize` made that decode a plain 2-D network
(`one_frame_vae.OneFrameDecode`; not measured on the GPU yet); its decode of several frames (a video, whose
decoder caches frames between chunks) stays eager unless ``extras`` names ``video-vae``. ``extras``
(``--compile-extra``; off by default, not measured on the GPU): ``text-encoder`` compiles an LLM text encoder's
language model whole with dynamic shapes, one graph for every prompt length (an LLM encoder dispatches thousands
of aten ops a pass eagerly); ``video-vae`` compiles a video VAE's chunked decode (Wan's: three graphs a size,
first chunk, second, the rest; eagerly its float32 elementwise work runs unfused).

Bounded recompiles: every distinct input signature of the transformer (the shapes and dtypes of its
tensor arguments: batch, tokens, text length) is a compile (``dynamic=False``: one graph per served
shape, no slower symbolic-shape graph). The first ``max_shapes`` signatures compile; a later one runs the
eager transformer (``torch.compiler.set_stance("force_eager")``), logged once per signature, so a
client asking for an odd size costs itself an eager call instead of every user a recompile. The VAE decoders
(AutoencoderKL's, a one-frame video VAE's) are bounded the same way, their latent sizes counted apart
(``vae_compiled_shapes``): before, every new size a client asked for compiled the decoder again. Dynamo's own
``recompile_limit`` is raised while compiled (restored by `CompileHandle.restore`) to the bound times the
layers of a regional block class (layers with different guarded attributes need their own graphs), so it
never falls back silently first.

What compiles is the transformer's forward inside any hook that pairs calls in Python state (`cfg_batch`, CFG
parallel: a pending CFG pair), which stays Python around it (`_compile_point`), so that state never becomes a
guard, and the shape bound and the warm-guard keys see the arguments the graphs are traced with.

Warm guards (``guards="warm"``, off by default): once a call of the same key (`call_key`: every
argument's structure, tensors by shape and dtype, the rest by value; grad / inference / autocast mode) has
run compiled without compiling anything (Dynamo's count of converted frames unchanged), later calls of
that key run under ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``: Dynamo evaluates only the
guards that told its cache entries apart during warm-up (the ones that ever failed), not every guard of every
entry. Why: regional compile puts all of a block class's layers on one code object, and NucleusMoE's layers
differ in guarded attributes (capacity factor, dense vs MoE), so each layer's call walks several entries, and
its compiled call is host-bound with much of the host time in "TorchDynamo Cache Lookup" (the torch-profiler
table of a bare call at 44c49d2 in ``benchmarks/results/serving/``). The mode is read on every call (``handle.guards``), so a
probe can compare both on the same graphs. Unsafe where a module attribute or global the graphs
depend on changes between calls of one key (nothing in this project's patches does that after warm-up).
Warm against full guards, on the GPU (``bench_serving.py served-path --profile``) and on the CPU (a 32-block
tiny NucleusMoE, eager backend), the same images: ``benchmarks/results/figures-from-code.md``.

Restore drops the graphs this handle compiled and only those: everything compiles through a
`_torch_private.OwnedCompiler` (entry code objects of its own), never ``torch._dynamo.reset()``, which drops
every compiled graph of the process (another pipeline's too). The recompile limits come back when the last
compiled stack restores.

In the feature stack this is the last feature (`apply`): it traces every patch above and reads what they left
in the `FeatureContext` (the one-frame decode to compile, the kernel chooser CUDA graphs restrict). Standalone,
call `apply_compile` after ``parallelize`` (its patches and custom ops are what gets traced). Example::

    handle = parallelize(pipe, ParallelConfig())           # world 1 too: the measured attention kernel
    compiled = apply_compile(pipe, "regional", max_shapes=4)
    pipe(prompt, height=1024, width=1024)                  # compiles this shape (warm-up)
    compiled.restore()
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from xstage_dit import _torch_private as private
from xstage_dit.families.spec import TEXT_ENCODER_COMPONENTS
from xstage_dit.features.context import FeatureContext, context_of
from xstage_dit.features.instance_attr import set_on_instance
from xstage_dit.features.text_depth import llm_decoder

log = logging.getLogger(__name__)

COMPILE_MODES = ("off", "regional", "full", "graphs")
GUARD_MODES = ("full", "warm")  # every guard on every call; only the differentiating ones once a key is warm
# The --compile-guards help of serve, generate and bench.
GUARDS_HELP = ("full = every Dynamo guard on every call (torch's default); warm = once a call of the same shapes and "
               "arguments has run compiled, only the guards that told the cached graphs apart "
               "(torch.compiler.set_stance(skip_guard_eval_unsafe=True)): less host time per call, unsafe if model "
               "attributes change between calls (default: %(default)s)")
# What --compile-extra adds (off by default: not measured on the GPU yet). text-encoder: an LLM text encoder's
# language model, whole; video-vae: a video VAE's decode of several frames (its chunks, frame cache and all).
EXTRAS = ("text-encoder", "video-vae")
GRAPHS_OPTIONS = {"triton.cudagraphs": True}  # Inductor's CUDA graphs (what mode="reduce-overhead" sets)
DEFAULT_MAX_SHAPES = 8
_COMPILED = "_xstage_compile_handle"  # on a transformer apply_compile compiled (a second call is an error)


def default_compile_mode(device: torch.device | str) -> str:
    """``regional`` on a GPU, ``off`` on a CPU."""
    return "regional" if torch.device(device).type == "cuda" else "off"


def check_extras(extras) -> tuple[str, ...]:
    """`extras` as a tuple when every name is one of `EXTRAS`; ValueError naming the first that is not."""
    extras = tuple(extras)
    for name in extras:
        if name not in EXTRAS:
            raise ValueError(f"expected compile extras from {', '.join(EXTRAS)}, got {name!r}")
    return extras


def parse_extras(text: str | None) -> tuple[str, ...]:
    """A --compile-extra value ("text-encoder,video-vae") as a tuple of `EXTRAS` names; ValueError naming a bad one."""
    return check_extras(n.strip() for n in str(text or "").split(",") if n.strip())


def check_compile_mode(mode: str) -> str:
    """`mode` when it is one of `COMPILE_MODES`; ValueError naming it otherwise."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"expected a compile mode in {', '.join(COMPILE_MODES)}, got {mode!r}")
    return mode


def signature_of(args: tuple, kwargs: dict) -> tuple:
    """What a compiled graph is specialised on: (name, shape, dtype) of every top-level tensor argument."""
    items = [(str(i), a) for i, a in enumerate(args)] + sorted(kwargs.items())
    return tuple((name, tuple(v.shape), str(v.dtype)) for name, v in items if isinstance(v, torch.Tensor))


def call_key(args: tuple, kwargs: dict) -> tuple:
    """What a warm call must match to skip guards: the structure of every argument (tensors by shape, dtype and
    device, at the top or inside a list or dict; a LoRA scale in ``attention_kwargs``, a flag by value) and the
    grad / inference / autocast modes the graphs were traced in."""
    items = [(str(i), a) for i, a in enumerate(args)] + sorted(kwargs.items())
    modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
             torch.is_autocast_enabled("cuda"), torch.is_autocast_enabled("cpu"))
    return tuple((name, _structure(v)) for name, v in items), modes


def _structure(value: Any):
    """A hashable stand-in for an argument: tensors by shape, dtype and device (never their values), containers
    item by item, anything else by its repr."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), str(value.device))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_structure(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), _structure(v)) for k, v in value.items()))
    return repr(value)


@dataclass
class CompileHandle:
    """What `apply_compile` did. mode / how: requested mode and what was compiled. compiled_shapes: the
    signatures that compiled (at most max_shapes); eager_shapes: those past the bound, run eager.
    vae_compiled_shapes / vae_eager_shapes: the same for the VAE decoder (its own count, the same bound)."""

    mode: str
    how: str
    max_shapes: int
    compiled_shapes: list = field(default_factory=list)
    eager_shapes: list = field(default_factory=list)
    guards: str = "full"
    vae_compiled_shapes: list = field(default_factory=list)  # the VAE decoder's, under the same bound
    vae_eager_shapes: list = field(default_factory=list)
    warm_keys: set = field(default_factory=set, repr=False)
    compiler: private.OwnedCompiler = field(default_factory=private.OwnedCompiler, repr=False)
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def describe(self) -> dict:
        return {"mode": self.mode, "how": self.how, "max_shapes": self.max_shapes, "guards": self.guards,
                "compiled_shapes": len(self.compiled_shapes), "eager_shapes": len(self.eager_shapes),
                "vae_compiled_shapes": len(self.vae_compiled_shapes), "vae_eager_shapes": len(self.vae_eager_shapes)}

    def restore(self) -> None:
        """Back to the eager transformer (idempotent). The graphs this handle compiled are dropped, and only
        those (`_torch_private.OwnedCompiler`): another pipeline's compiled graphs stay."""
        while self._undo:
            self._undo.pop()()


def _replayed(compiled: Callable) -> Callable:
    """`compiled` under CUDA graphs, made safe to call twice before reading: a new graph generation each call,
    the outputs cloned out of the graph's pool (the next replay overwrites it)."""

    def call(*args: Any, **kwargs: Any):
        torch.compiler.cudagraph_mark_step_begin()
        return clone_tensors(compiled(*args, **kwargs))

    return call


def clone_tensors(value: Any) -> Any:
    """`value` with every tensor in it cloned: a tensor, a tuple or list, or a diffusers output (a dict). Also what
    `prompt_cache` hands back from its cache."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)) and not hasattr(value, "keys"):
        return type(value)(clone_tensors(v) for v in value)
    if hasattr(value, "keys"):  # diffusers' BaseOutput: an ordered dict with attribute access
        return type(value)(**{k: clone_tensors(value[k]) for k in value.keys()})
    return value


def _warm_guarded(handle: CompileHandle, compiled: Callable) -> Callable:
    """`compiled`, run with only the differentiating guards once its call key has run (see the module docstring)
    while ``handle.guards`` is "warm": read on every call, so a probe can switch it between calls."""

    def call(*args: Any, **kwargs: Any):
        if handle.guards != "warm":
            return compiled(*args, **kwargs)
        key = call_key(args, kwargs)
        if key in handle.warm_keys:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return compiled(*args, **kwargs)
        converted = private.frames_converted()  # Dynamo's count of frames it was asked to convert: a miss each
        out = compiled(*args, **kwargs)
        # Warm once a call of the key reached no new frame or graph, not after its first call: what runs inside
        # can still move on (a hook's state: `cfg_batch` runs its first pair of a shape plainly and later pairs
        # as one batch, new graphs reached by the same outer key), and a compile needed under the warm stance
        # raises ("Recompilation triggered with skip_guard_eval_unsafe stance", tiny NucleusMoE, 2026-12-05).
        if private.frames_converted() == converted:
            handle.warm_keys.add(key)
        return out

    return call


def _bounded(what: str, max_shapes: int, compiled_shapes: list, eager_shapes: list, eager: Callable,
             compiled: Callable) -> Callable:
    """`compiled` for the first `max_shapes` input signatures (`signature_of`), `eager` for any later one (logged
    once per signature, run under ``force_eager`` so nothing inside it compiles either). The signatures seen go
    into `compiled_shapes` / `eager_shapes` (the handle's report)."""

    @functools.wraps(eager)
    def forward(*args: Any, **kwargs: Any):
        sig = signature_of(args, kwargs)
        if sig in compiled_shapes:
            return compiled(*args, **kwargs)
        if sig not in eager_shapes and len(compiled_shapes) < max_shapes:
            compiled_shapes.append(sig)
            log.info("compile (%s): new shape %d of at most %d: %s", what, len(compiled_shapes), max_shapes, sig)
            return compiled(*args, **kwargs)
        if sig not in eager_shapes:
            eager_shapes.append(sig)
            log.warning("compile (%s): shape %s would be compile number %d, past the bound of %d: it runs eager",
                        what, sig, max_shapes + 1, max_shapes)
        with torch.compiler.set_stance("force_eager"):
            return eager(*args, **kwargs)

    return forward


def _guard(handle: CompileHandle, eager: Callable, compiled: Callable) -> Callable:
    if handle.mode == "graphs":
        compiled = _replayed(compiled)
    compiled = _warm_guarded(handle, compiled)
    return _bounded(handle.mode, handle.max_shapes, handle.compiled_shapes, handle.eager_shapes, eager, compiled)


def _vae_bound(handle: CompileHandle) -> Callable[[Callable, Callable], Callable]:
    """The same bound for a VAE decoder, counted apart from the transformer's (``vae_compiled_shapes``): a client
    asking for ever new sizes must not cost every user a decoder compile each."""
    return functools.partial(_bounded, "vae decoder", handle.max_shapes, handle.vae_compiled_shapes,
                             handle.vae_eager_shapes)


@dataclass(frozen=True)
class CompileConfig:
    """What the compile feature compiles (validated on construction; the module docstring says how).

    mode: one of `COMPILE_MODES` ("off": nothing).
    max_shapes: input signatures compiled per transformer before further ones run eager (>= 1).
    backend: the torch.compile backend ("inductor"; tests use "eager" to check the wiring fast).
    options: Inductor options for these graphs only (``torch.compile(options=...)``), e.g.
        ``{"coordinate_descent_tuning": True}``; None = Inductor's defaults.
    vae: also compile an image VAE's decoder (``AutoencoderKL``; the benchmark's plain-diffusers baseline
        passes False: users compile the transformer alone) and a video VAE's one-frame decode.
    guards: "full" (every guard, every call) or "warm" (only the differentiating guards once a call key has
        run; the module docstring says why and when that is unsafe).
    extras: any of `EXTRAS` (not measured on the GPU yet): "text-encoder", each LLM text encoder's language model
        whole (`_text_models`: NucleusMoE's Qwen3-VL, FLUX.2's Mistral), ``dynamic=True``: one graph for every
        prompt length; "video-vae", a video VAE's chunked decode of several frames (`OneFrameDecode.compile`).
    """

    mode: str = "off"
    max_shapes: int = DEFAULT_MAX_SHAPES
    backend: Any = "inductor"
    options: dict | None = None
    vae: bool = True
    guards: str = "full"
    extras: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_compile_mode(self.mode)
        object.__setattr__(self, "extras", check_extras(self.extras))
        if self.guards not in GUARD_MODES:
            raise ValueError(f"expected guards in {', '.join(GUARD_MODES)}, got {self.guards!r}")
        if not isinstance(self.max_shapes, int) or isinstance(self.max_shapes, bool) or self.max_shapes < 1:
            raise ValueError(f"expected max_shapes to be an integer >= 1, got {self.max_shapes!r}")
        if self.options is not None and not isinstance(self.options, dict):
            raise ValueError(f"expected options to be a dict of Inductor options or None, got {self.options!r}")


def apply_compile(pipe: Any, mode: str, *, max_shapes: int = DEFAULT_MAX_SHAPES,
                  backend: str = "inductor", options: dict | None = None, vae: bool = True,
                  guards: str = "full", extras: tuple[str, ...] = ()) -> CompileHandle:
    """Compile `pipe.transformer` (and ``transformer_2`` where present) in `mode`, and an image VAE's decoder
    unless `vae` is False, after the stack that patched `pipe` (``parallelize``: what the compile feature reads
    from its context, the one-frame decode and the kernel chooser). The arguments are `CompileConfig`'s.
    Returns a `CompileHandle`; mode "off" returns one that did nothing."""
    config = CompileConfig(mode, max_shapes, backend, options, vae, guards, tuple(extras))
    return compile_pipeline(pipe, config, context_of(pipe))


def apply(pipe: Any, config: CompileConfig, ctx: FeatureContext) -> Callable[[], None]:
    """The stack's compile feature: `compile_pipeline` with what earlier features left in `ctx`; the handle goes
    to ``ctx.compiled``. Returns its undo."""
    ctx.compiled = compile_pipeline(pipe, config, ctx)
    return ctx.compiled.restore


def compile_pipeline(pipe: Any, config: CompileConfig, ctx: FeatureContext) -> CompileHandle:
    """Compile `pipe` as `config` says (the module docstring); `ctx` gives the kernel chooser (CUDA graphs take
    only capturable kernels) and the one-frame decode of a video VAE."""
    if config.mode == "off":
        return CompileHandle(config.mode, "eager (compile off)", config.max_shapes)
    transformer = getattr(pipe, "transformer", None)
    if not isinstance(transformer, torch.nn.Module):
        raise ValueError(f"expected a pipeline with a .transformer module to compile, got {type(pipe).__name__}")
    if getattr(transformer, _COMPILED, None) is not None:
        raise RuntimeError("expected a transformer not compiled yet, got one compiled by apply_compile: restore() first")
    targets = [transformer] + [m for m in [getattr(pipe, "transformer_2", None)] if isinstance(m, torch.nn.Module)]
    handle = CompileHandle(config.mode, "", config.max_shapes, guards=config.guards)
    handle._undo.append(handle.compiler.drop)  # last: the graphs of this handle, nobody else's
    try:
        if ctx.attention_kernels is not None:
            handle._undo.append(ctx.attention_kernels.for_compile())  # kernels timed compiled chosen by that time
        if config.mode == "graphs" and ctx.attention_kernels is not None:
            handle._undo.append(ctx.attention_kernels.for_cuda_graphs())  # no kernel a capture breaks
        hows, per_code_object = _compile_transformers(handle, targets, config, ctx.compile_inside)
        # LoRA hot-swap slots: a graph with the LoRA layers on and one with them off, per shape (`features.lora`)
        per_code_object *= ctx.lora.graph_variants if ctx.lora is not None else 1
        handle._undo.append(private.raise_recompile_limits(per_code_object, 2 * per_code_object))
        if config.vae:
            hows += _compile_vae_decoders(handle, pipe, config, ctx)
        if "text-encoder" in config.extras:
            hows += _compile_text_encoders(handle, pipe, config)
    except BaseException:
        handle.restore()
        raise
    if config.guards == "warm":
        hows.append("warm guards (only the differentiating ones once a call key has run)")
    handle.how = "; ".join(hows)
    log.info("compile %s (%s backend, dynamic=False, at most %d shapes, then eager): %s", config.mode,
             config.backend, config.max_shapes, handle.how)
    return handle


def _options(config: CompileConfig, graphs: bool) -> dict:
    """torch.compile's ``options`` keyword for these graphs ({} for Inductor's defaults); `graphs`: under CUDA
    graphs (Inductor's option; other backends test the wiring)."""
    options = config.options
    if graphs and config.mode == "graphs" and config.backend == "inductor":
        options = {**(options or {}), **GRAPHS_OPTIONS}
    return {} if options is None else {"options": dict(options)}


def _compile_transformers(handle: CompileHandle, targets: list, config: CompileConfig,
                          inside: list = ()) -> tuple[list[str], int]:
    """Compile each transformer (regional blocks, or its whole forward) behind the shape bound, and the forwards
    a step cache's hooks call (`inside`: ``ctx.compile_inside``); returns what was compiled and the graphs a code
    object may need (the recompile limit)."""
    hows, per_code_object = [], config.max_shapes
    extra = _options(config, graphs=True)
    below_hooks = {id(point.module) for point in inside}
    for module in targets:
        owner, attr = _compile_point(module)
        eager = getattr(owner, attr)
        blocks = set(getattr(module, "_repeated_blocks", None) or ())
        regions = [m for m in module.modules() if type(m).__name__ in blocks] if config.mode == "regional" else []
        per_code_object = max(per_code_object, config.max_shapes * max(1, len(regions)))
        # A block a cache hook wraps compiles below its hook (`_compile_inside`), not as a region around it.
        regions = [m for m in regions if id(m) not in below_hooks]
        # Every layer of a block class runs one code object, and layers whose guarded attributes differ (a MoE
        # layer's capacity factor, a dense layer among MoE ones) each need their own graph per shape: up to
        # (layers x shapes) graphs. Dynamo's default limit of 8 per code object made NucleusMoE's later
        # layer/shape pairs fall back to eager silently (H200, 2026-12-04: "hit config.recompile_limit (8)",
        # guard "img_mlp.capacity_factor == 4.0"), more of them in the server, whose warm-up prompt adds shapes.
        # The bound on served shapes is `_guard`'s, per transformer signature, not Dynamo's.
        if regions or (config.mode == "regional" and blocks and inside):
            for region in regions:
                handle.compiler.compile_region(region, dynamic=False, backend=config.backend, **extra)
            compiled = eager  # the blocks inside compile; the glue around them stays eager
            hows.append(f"regional: {len(regions)} {'/'.join(sorted(blocks))} blocks of {type(module).__name__}"
                        + (" (the others below their cache hooks)" if inside else ""))
        else:
            compiled = handle.compiler.compile(eager, dynamic=False, backend=config.backend, **extra)
            what = "no repeated blocks, whole" if config.mode == "regional" else "whole"
            graphs = " under CUDA graphs" if config.mode == "graphs" else ""
            hows.append(f"{config.mode}: {what} {type(module).__name__} forward{graphs}")
        handle._undo.append(set_on_instance(owner, attr, _guard(handle, eager, compiled)))
        handle._undo.append(set_on_instance(module, _COMPILED, handle))
    if inside:
        hows.append(_compile_inside(handle, inside, config))
    return hows, per_code_object


def _compile_inside(handle: CompileHandle, points: list, config: CompileConfig) -> str:
    """Each module a step cache's hook calls when it computes: its class forward compiled (one owned entry per
    class) in the point's ``fn``, the hook left eager; any other ``fn`` stays eager, logged. Returns what compiled."""
    extra = _options(config, graphs=False)
    counts: dict[str, int] = {}
    for point in points:
        module, fn = point.module, point.fn
        if getattr(fn, "__self__", None) is not module or getattr(fn, "__func__", None) is not type(module).forward:
            log.info("compile: %s runs eager below its cache hook (another hook sits inside it)", type(module).__name__)
            continue
        compiled = handle.compiler.compile_class_forward(module, dynamic=False, backend=config.backend, **extra)
        point.fn = compiled
        handle._undo.append(functools.partial(setattr, point, "fn", fn))
        counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    return "below the step cache's hooks: " + (", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none")


def _compile_vae_decoders(handle: CompileHandle, pipe: Any, config: CompileConfig, ctx: FeatureContext) -> list[str]:
    """An image VAE's decoder, and a video VAE's one-frame decode as the one-frame feature left it (``ctx``);
    never under CUDA graphs. Returns what was compiled."""
    hows, extra = [], _options(config, graphs=False)
    decoder = _image_vae_decoder(pipe)
    if decoder is not None:
        decoder_eager = decoder.forward
        compiled = handle.compiler.compile(decoder_eager, dynamic=False, backend=config.backend, **extra)
        handle._undo.append(set_on_instance(decoder, "forward", _vae_bound(handle)(decoder_eager, compiled)))
        hows.append(f"the {type(pipe.vae).__name__} decoder")
    one_frame = ctx.one_frame_decode
    if one_frame is not None:  # a video VAE's one-frame decode, as the one-frame feature leaves it: a 2-D network
        chunks = "video-vae" in config.extras
        one_frame.compile(wrap=_vae_bound(handle), chunks=chunks, compile_fn=handle.compiler.compile,
                          backend=config.backend, **extra)
        handle._undo.append(one_frame.uncompile)
        hows.append(f"the {type(pipe.vae).__name__} decoder of one-frame latents" +
                    (" and of several frames (chunked)" if chunks else ""))
    return hows


def _compile_text_encoders(handle: CompileHandle, pipe: Any, config: CompileConfig) -> list[str]:
    """Each LLM text encoder's language model, whole, any prompt length. Returns what was compiled."""
    hows, extra = [], _options(config, graphs=False)
    for name, model in _text_models(pipe):
        # Whole, not by layers: transformers records the hidden states through hooks that read a ContextVar,
        # which Dynamo traces only when the recording starts inside the compiled code (one graph, no break, on
        # the tiny Qwen3-VL); dynamic: prompts differ in length, and a length compiled each would stall a request.
        compiled = handle.compiler.compile(model.forward, dynamic=True, backend=config.backend, **extra)
        handle._undo.append(set_on_instance(model, "forward", compiled))
        hows.append(f"the {type(model).__name__} of {name} (whole, any prompt length)")
    return hows


def _compile_point(module: torch.nn.Module) -> tuple[Any, str]:
    """(object, attribute) holding what compiles: where a diffusers hook on the module pairs calls in Python state
    (``outside_compile = True``: `cfg_batch`'s and CFG parallel's, a pending CFG pair), the reference the innermost
    such hook calls through (its ``original_forward``: the hooks inside it and the module's forward); else the
    instance's ``forward`` (the whole hook chain, as before: the sequence-parallel split and the input agreement
    check, which skips itself while compiling, stay inside the graphs). A pairing hook's state never becomes a
    Dynamo guard, and the bound and the warm-guard keys see the arguments the graphs are traced with (a CFG
    pair's batch of two, not the first call's batch of one)."""
    registry = getattr(module, "_diffusers_hook", None)
    references = getattr(registry, "_fn_refs", None) or []
    hooks = [registry.hooks[name] for name in getattr(registry, "_hook_order", [])] if references else []
    for hook, reference in zip(hooks, references):  # registered first = innermost
        if getattr(hook, "outside_compile", False) and reference.original_forward is not None:
            return reference, "original_forward"
    return module, "forward"


def _text_models(pipe: Any) -> list[tuple[str, torch.nn.Module]]:
    """(component name, language model) of every text encoder that is a decoder LLM (`text_depth.llm_decoder`)."""
    found = []
    for name in TEXT_ENCODER_COMPONENTS:
        decoder = llm_decoder(getattr(pipe, name, None))
        if decoder is not None:
            found.append((name, decoder))
    return found


def _image_vae_decoder(pipe: Any) -> torch.nn.Module | None:
    """The decoder of the pipeline's image VAE (``AutoencoderKL``), the one VAE measured faster compiled."""
    vae = getattr(pipe, "vae", None)
    decoder = getattr(vae, "decoder", None)
    if type(vae).__name__ != "AutoencoderKL" or not isinstance(decoder, torch.nn.Module):
        return None
    return decoder
