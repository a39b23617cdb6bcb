"""xDiT/xfuser (pinned: `XFUSER_PIN`) as a contender of the end-to-end benchmark, the way its users run it.

Two ways in, chosen per pipeline class:

- **pipeline wrapper** (FLUX and the other classes xfuser registers in ``xFuserPipelineWrapperRegister``): the
  wrapper built over our pipeline with Ulysses degree = GPU count (ring degree 1), as xfuser's examples do.
- **model runner** (`RUNNER_MODELS`: Wan 2.1 text-to-video). xfuser 0.7.0 wraps no ``WanPipeline``; its
  ``xfuser`` command runs Wan through a runner (``xFuserWan21T2VModel``) that builds its own transformer class
  (``xFuserWanTransformer3DWrapper``: the diffusers Wan transformer with xfuser's Ulysses attention processors)
  and a ``WanPipeline`` from a weights folder, then sets up its runtime state and, with ``use_torch_compile``,
  compiles the transformer and warms it up. `_InMemoryRunner` is that runner with one change: ``_load_model``
  builds the wrapper over *our* transformer's parameters (shared, not copied: a 14B model has no room for a
  second copy) and a pipeline of our components, since no weights folder exists here. Everything after loading
  (runtime state, attention backend choice, compile) is xfuser's own code. The benchmark then calls that
  pipeline with the same arguments (prompt, seed's generator, steps) as every other contender.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import sys

import torch

from xstage_dit.bench.contender import Contender
from xstage_dit.bench.session import Bench, error_text

XFUSER_PIN = "0.7.0"  # pyproject.toml, extra "bench"
# For pipeline classes xfuser has no wrapper for: the name its runner is registered under, and the transformer
# class that runner's loader builds ("module:attribute").
RUNNER_MODELS = {
    "WanPipeline": ("Wan2.1-T2V",
                    "xfuser.model_executor.models.transformers.transformer_wan:xFuserWanTransformer3DWrapper"),
}


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def give_flash_attn_a_version() -> None:
    """xfuser's compile path reads ``flash_attn.__version__`` whenever ``flash_attn`` is imported; flash-attn-4
    (imported by our kernel sweep in the same process) is a namespace package without one, and xfuser+compile
    then failed with AttributeError (H200, 2026-12-03). Give it the installed distribution's version."""
    module = sys.modules.get("flash_attn")
    if module is not None and not hasattr(module, "__version__"):
        module.__version__ = _version("flash-attn-4") or _version("flash-attn") or "0"


def runner_input_args(kwargs: dict, seed: int, flow_shift: float | None) -> dict:
    """The ``input_args`` an xfuser runner's ``initialize`` takes (its compile warm-up runs them), from the
    benchmark's pipeline kwargs of one call (`Bench.call_kwargs`). flow_shift: the pipeline scheduler's own, so
    the runner's set-up (which writes it into the scheduler config) leaves the schedule as every contender has
    it; None where the scheduler has none."""
    missing = [k for k in ("prompt", "height", "width", "num_inference_steps", "guidance_scale") if k not in kwargs]
    if missing:
        raise ValueError(f"expected pipeline kwargs with {', '.join(missing)}, got {sorted(kwargs)}")
    args = {key: kwargs[key] for key in ("prompt", "height", "width", "num_inference_steps", "guidance_scale")}
    args.update(negative_prompt=kwargs.get("negative_prompt"), guidance_scale_2=kwargs.get("guidance_scale_2"),
                num_frames=kwargs.get("num_frames"), seed=seed)
    if flow_shift is not None:
        args["flow_shift"] = flow_shift
    return args


def rebuilt_pipeline(pipe, **replace):
    """A pipeline of `pipe`'s class over the same components (modules shared, nothing copied), with `replace`
    swapped in; the class's config-only arguments (WanPipeline's ``boundary_ratio``, ``expand_timesteps``) are
    carried over from ``pipe.config``."""
    parameters = inspect.signature(type(pipe).__init__).parameters
    unknown = sorted(set(replace) - set(parameters))
    if unknown:
        raise ValueError(f"expected components of {type(pipe).__name__}, got {unknown}")
    components = dict(pipe.components)
    values = {}
    for name in parameters:
        if name == "self":
            continue
        if name in replace:
            values[name] = replace[name]
        elif name in components:
            values[name] = components[name]
        elif name in pipe.config:
            values[name] = pipe.config[name]
    rebuilt = type(pipe)(**values)
    if hasattr(rebuilt, "set_progress_bar_config"):
        rebuilt.set_progress_bar_config(disable=True)
    return rebuilt


class XFuserUSP(Contender):
    """xDiT/xfuser's USP: Ulysses degree = GPU count (ring degree 1), through its pipeline wrapper where it has
    one for the pipeline class, else through its model runner (`RUNNER_MODELS`; see the module docstring)."""

    family = "xfuser-usp"

    def __init__(self, compile: bool, world_size: int):
        super().__init__(compile)
        # At degree > 1 the wrapper replaces attention layers inside the transformer: no way back.
        self.irreversible = world_size > 1
        self.wrapper = None
        self.runner_class = self.transformer_class = None
        self.runner = None
        self.flow_shift = None
        self.saved: dict = {}
        self.had_forward_attr = False

    def check(self, b: Bench) -> str | None:
        version = _version("xfuser")
        if version is None:
            return f"xfuser is not installed (the bench extra pins xfuser=={XFUSER_PIN})"
        self.info["xfuser_version"] = version
        try:
            import xfuser  # noqa: F401
            from xfuser.model_executor.pipelines.register import xFuserPipelineWrapperRegister
        except Exception as exc:
            return f"xfuser {version} does not import here: {error_text(exc)}"
        try:
            self.wrapper_class = xFuserPipelineWrapperRegister.get_class(b.pipe)
            self.info["xfuser_path"] = "pipeline wrapper"
            return None
        except Exception as exc:
            no_wrapper = f"xfuser {version} has no pipeline wrapper for {type(b.pipe).__name__}: {error_text(exc)}"
        runner_name, transformer_class = RUNNER_MODELS.get(type(b.pipe).__name__, (None, None))
        if runner_name is None:
            return no_wrapper
        try:
            import xfuser.model_executor.models.runner_models  # noqa: F401 - registers the runners
            from xfuser.model_executor.models.runner_models.base_model import MODEL_REGISTRY
        except Exception as exc:
            return f"{no_wrapper}; its model runners do not import here: {error_text(exc)}"
        self.runner_class = MODEL_REGISTRY.get(runner_name)
        if self.runner_class is None:
            return f"{no_wrapper}; no model runner registered as {runner_name!r} either"
        module, _, attribute = transformer_class.partition(":")
        try:
            self.transformer_class = getattr(importlib.import_module(module), attribute)
        except Exception as exc:
            return (f"{no_wrapper}; its runner's transformer class {transformer_class} does not import: "
                    f"{error_text(exc)}")
        self.info["xfuser_path"] = f"model runner {runner_name} ({self.runner_class.__name__}), our weights"
        return None

    def _setup(self, b: Bench) -> None:
        from xfuser.core.distributed import init_distributed_environment

        b.ensure_process_group()
        give_flash_attn_a_version()
        init_distributed_environment(rank=b.rank, world_size=b.world_size)  # adopts the existing group

    def apply(self, b: Bench) -> None:
        self._setup(b)
        if self.runner_class is not None:
            self._apply_runner(b)
            return
        from xfuser import xFuserArgs

        engine_config, _ = xFuserArgs(
            model=b.args.model, ulysses_degree=b.world_size, ring_degree=1, use_torch_compile=self.compile,
            height=b.height, width=b.width, num_inference_steps=b.steps, seed=b.args.seed,
        ).create_config()
        # The wrapper swaps the pipeline's transformer/scheduler/vae for its own: keep them to put back.
        self.saved = {name: getattr(b.pipe, name) for name in ("transformer", "scheduler", "vae")
                      if getattr(b.pipe, name, None) is not None}
        # With use_torch_compile it sets a compiled `forward` on the transformer instance itself.
        self.had_forward_attr = "forward" in vars(b.pipe.transformer)
        self.wrapper = self.wrapper_class(b.pipe, engine_config)
        if self.compile:
            self.info["compile_mode"] = "xfuser use_torch_compile (torch.compile of the transformer's forward)"
        naive = getattr(self.wrapper, "use_naive_forward", None)
        if callable(naive):
            # At degree 1 xfuser runs the unmodified diffusers pipeline: record it, the table says so.
            self.info["xfuser_naive_forward"] = bool(naive())

    def _apply_runner(self, b: Bench) -> None:
        from xfuser import xFuserArgs

        kwargs = b.call_kwargs(b.prompts[0], b.steps)
        config = xFuserArgs(model=self.runner_class.settings.model_name, ulysses_degree=b.world_size, ring_degree=1,
                            use_torch_compile=self.compile, height=b.height, width=b.width,
                            num_frames=kwargs.get("num_frames") or 1, num_inference_steps=b.steps, seed=b.args.seed)
        vae = getattr(b.pipe, "vae", None)
        self.saved = {"vae_flags": {k: getattr(vae, k) for k in ("use_tiling", "use_slicing") if hasattr(vae, k)}}
        self.runner = _in_memory_runner(self.runner_class, self.transformer_class)(config, b.pipe)
        self.flow_shift = getattr(b.pipe.scheduler.config, "flow_shift", None)
        # Loads (our components), sets up xfuser's runtime state, and with compile: compiles and runs its warm-up.
        self.runner.initialize(runner_input_args(kwargs, b.args.seed, self.flow_shift))
        if self.compile:
            self.info["compile_mode"] = "xfuser use_torch_compile (its runner: torch.compile of the transformer)"
        from xfuser.core.distributed import get_runtime_state

        backend = getattr(get_runtime_state(), "attention_backend", None)
        if backend is not None:
            self.info["xfuser_attention_backend"] = str(backend)

    def timed_module(self, b: Bench) -> torch.nn.Module:
        return self.runner.pipe.transformer if self.runner is not None else b.pipe.transformer

    def call(self, b: Bench, kwargs: dict):
        if self.runner is not None:
            # What the runner does before each of its pipeline calls (Wan: reset its per-step schedule state).
            self.runner.prepare_run(runner_input_args(kwargs, b.args.seed, self.flow_shift))
            return self.runner.pipe(**kwargs)
        return self.wrapper(**kwargs)

    def restore(self, b: Bench) -> None:
        flags = self.saved.pop("vae_flags", None)
        if flags is not None:
            for key, value in flags.items():
                setattr(b.pipe.vae, key, value)
        for name, module in self.saved.items():
            setattr(b.pipe, name, module)
        transformer = self.saved.get("transformer")
        if transformer is not None and not self.had_forward_attr and "forward" in vars(transformer):
            del transformer.forward
        self.saved, self.wrapper, self.runner = {}, None, None
        if self.compile:
            torch._dynamo.reset()
        if self.irreversible:
            b.dirty = self.family


def _in_memory_runner(runner_class, wrapper_class):
    """`runner_class` (an xfuser model runner) whose ``_load_model`` wraps our pipeline instead of reading a
    weights folder: `wrapper_class` (the transformer class its loader builds) over our transformer's parameters
    (assigned, not copied; the class's own buffers are built on the host, then moved), our other components."""
    import accelerate

    class _InMemoryRunner(runner_class):
        def __init__(self, config, pipe):
            super().__init__(config)
            self._ours = pipe

        def _load_model(self):
            ours = self._ours.transformer
            extra = {}
            build_kwargs = getattr(sys.modules[runner_class.__module__], "_build_attention_kwargs", None)
            if "attention_kwargs" in inspect.signature(wrapper_class.__init__).parameters and build_kwargs:
                extra["attention_kwargs"] = build_kwargs(self.config)  # as the runner's own loader passes it
            with accelerate.init_empty_weights():  # parameters on meta; buffers real, on the host
                wrapper = wrapper_class.from_config(ours.config, **extra)
            wrapper.load_state_dict(ours.state_dict(), strict=True, assign=True)
            wrapper.to(device=ours.device)  # the buffers: the parameters are ours, already there
            wrapper.eval()
            return rebuilt_pipeline(self._ours, transformer=wrapper)

    _InMemoryRunner.__name__ = f"InMemory{runner_class.__name__}"
    return _InMemoryRunner

