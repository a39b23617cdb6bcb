"""xDiT/xfuser (pinned: `XFUSER_PIN`) as contenders of the end-to-end benchmark, the two ways its users run it.

- ``xfuser-usp`` (`XFuserUSP`): the **pipeline wrapper** xfuser registers for the pipeline class
  (``xFuserPipelineWrapperRegister``: FLUX and others), built over our pipeline with Ulysses degree = GPU count
  (ring degree 1), as xfuser's example scripts do. At degree 1 it runs the unmodified diffusers pipeline.
- ``xfuser-runner`` (`XFuserRunner`): the **model runner** behind xfuser's ``xfuser`` command
  (`RUNNER_MODELS`: FLUX.1-dev, Wan 2.1 T2V; xfuser 0.7.0 has no pipeline wrapper for ``WanPipeline`` at all).
  A runner builds its own transformer class (FLUX's ``xFuserFlux1Transformer2DWrapper``, Wan's
  ``xFuserWanTransformer3DWrapper``: the diffusers transformer with xfuser's attention processors) and the
  pipeline from a weights folder, sets up its runtime state (the attention backend it picks: FLASH_4 where
  FlashAttention-4 is installed, else cuDNN on a GPU) and with ``use_torch_compile`` compiles the transformer
  its own way (FLUX: ``mode="reduce-overhead"``, CUDA graphs) and warms it up. `_in_memory_runner` is that
  runner with one change: ``_load_model`` builds the transformer class over *our* transformer's parameters
  (shared, not copied: a 14B model has no room for a second copy) and a pipeline of our components, since no
  weights folder exists here. Everything after loading is xfuser's own code; each timed call gets the same
  arguments (prompt, the seed's generator, steps) as every other contender, after the runtime-state set-up
  the runner's own ``_run_pipe`` does.
"""

from __future__ import annotations

import copy
import importlib
import importlib.metadata
import inspect
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from xstage_dit.bench.contender import Contender
from xstage_dit.bench.session import Bench, error_text
from xstage_dit.features.instance_attr import keep_instance_attr

XFUSER_PIN = "0.7.0"  # pyproject.toml, extra "bench"


@dataclass(frozen=True)
class RunnerModel:
    """An xfuser model runner. name: what xfuser registers it under; transformer: "module:attribute" of the
    transformer class its loader builds; sets_input_parameters: its ``_run_pipe`` tells the runtime state the
    call's sizes before calling the pipeline (FLUX), which the contender then does too."""

    name: str
    transformer: str
    sets_input_parameters: bool = False


_TRANSFORMERS = "xfuser.model_executor.models.transformers"
# diffusers pipeline class -> the xfuser runner of that model.
RUNNER_MODELS = {
    "FluxPipeline": RunnerModel("FLUX.1-dev", f"{_TRANSFORMERS}.transformer_flux:xFuserFlux1Transformer2DWrapper",
                                sets_input_parameters=True),
    "WanPipeline": RunnerModel("Wan2.1-T2V", f"{_TRANSFORMERS}.transformer_wan:xFuserWanTransformer3DWrapper"),
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
                num_frames=kwargs.get("num_frames"), max_sequence_length=kwargs.get("max_sequence_length", 512),
                seed=seed)
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


class _XFuser(Contender):
    """What both xfuser contenders share: the version check and the distributed set-up."""

    def __init__(self, compile: bool, world_size: int):
        super().__init__(compile)
        self.world_size = world_size

    def check(self, b: Bench) -> str | None:
        version = _version("xfuser")
        if version is None:
            return f"xfuser is not installed (the bench extra pins xfuser=={XFUSER_PIN})"
        self.info["xfuser_version"] = version
        try:
            import xfuser  # noqa: F401
        except Exception as exc:
            return f"xfuser {version} does not import here: {error_text(exc)}"
        return None

    def _setup(self, b: Bench) -> None:
        from xfuser.core.distributed import init_distributed_environment

        b.ensure_process_group()
        give_flash_attn_a_version()
        init_distributed_environment(rank=b.rank, world_size=b.world_size)  # adopts the existing group


class XFuserUSP(_XFuser):
    """xDiT/xfuser's USP through its pipeline wrapper: Ulysses degree = GPU count (ring degree 1)."""

    family = "xfuser-usp"

    def __init__(self, compile: bool, world_size: int):
        super().__init__(compile, world_size)
        # At degree > 1 the wrapper replaces attention layers inside the transformer: no way back.
        self.irreversible = world_size > 1
        self.wrapper = None
        self.saved: dict = {}
        self.restore_forward: Callable[[], None] | None = None  # puts back the transformer's own `forward`

    def check(self, b: Bench) -> str | None:
        reason = super().check(b)
        if reason is not None:
            return reason
        try:
            from xfuser.model_executor.pipelines.register import xFuserPipelineWrapperRegister

            self.wrapper_class = xFuserPipelineWrapperRegister.get_class(b.pipe)
        except Exception as exc:
            return (f"xfuser {self.info['xfuser_version']} has no pipeline wrapper for {type(b.pipe).__name__}: "
                    f"{error_text(exc)}")
        return None

    def apply(self, b: Bench) -> None:
        self._setup(b)
        from xfuser import xFuserArgs

        engine_config, _ = xFuserArgs(
            model=b.args.model, ulysses_degree=b.world_size, ring_degree=1, use_torch_compile=self.compile,
            height=b.height, width=b.width, num_inference_steps=b.steps, seed=b.args.seed,
        ).create_config()
        # The wrapper swaps the pipeline's transformer/scheduler/vae for its own: keep them to put back.
        self.saved = {name: getattr(b.pipe, name) for name in ("transformer", "scheduler", "vae")
                      if getattr(b.pipe, name, None) is not None}
        # With use_torch_compile it sets a compiled `forward` on the transformer instance itself, over any the
        # instance held (a diffusers hook's, another patch's): keep that one to put back.
        self.keep_own_forward(b.pipe.transformer)
        self.wrapper = self.wrapper_class(b.pipe, engine_config)
        if self.compile:
            self.info["compile_mode"] = "xfuser use_torch_compile (torch.compile of the transformer's forward)"
        naive = getattr(self.wrapper, "use_naive_forward", None)
        if callable(naive):
            # At degree 1 xfuser runs the unmodified diffusers pipeline: record it, the table says so.
            self.info["xfuser_naive_forward"] = bool(naive())

    def keep_own_forward(self, transformer: torch.nn.Module) -> None:
        self.restore_forward = keep_instance_attr(transformer, "forward")

    def call(self, b: Bench, kwargs: dict):
        return self.wrapper(**kwargs)

    def restore(self, b: Bench) -> None:
        for name, module in self.saved.items():
            setattr(b.pipe, name, module)
        if self.restore_forward is not None:
            self.restore_forward()
        self.restore_forward = None
        self.saved, self.wrapper = {}, None
        if self.compile:
            torch._dynamo.reset()
        if self.irreversible:
            b.dirty = self.family


class XFuserRunner(_XFuser):
    """xDiT/xfuser's model runner (its ``xfuser`` command) over our weights, Ulysses degree = GPU count (see the
    module docstring). Our pipeline and transformer stay as they were: the runner's transformer is another
    module over the same parameters."""

    family = "xfuser-runner"

    def __init__(self, compile: bool, world_size: int):
        super().__init__(compile, world_size)
        self.model = self.runner_class = self.transformer_class = None
        self.runner = None
        self.flow_shift = None
        self.saved: dict = {}

    def check(self, b: Bench) -> str | None:
        reason = super().check(b)
        if reason is not None:
            return reason
        version = self.info["xfuser_version"]
        self.model = RUNNER_MODELS.get(type(b.pipe).__name__)
        if self.model is None:
            return (f"xfuser {version} has no model runner for {type(b.pipe).__name__} here (runners used: "
                    f"{', '.join(sorted(RUNNER_MODELS))})")
        try:
            import xfuser.model_executor.models.runner_models  # noqa: F401 - registers the runners
            from xfuser.model_executor.models.runner_models.base_model import MODEL_REGISTRY

            module, _, attribute = self.model.transformer.partition(":")
            self.transformer_class = getattr(importlib.import_module(module), attribute)
        except Exception as exc:
            return f"xfuser {version}'s model runners do not import here: {error_text(exc)}"
        self.runner_class = MODEL_REGISTRY.get(self.model.name)
        if self.runner_class is None:
            return f"xfuser {version} registers no model runner {self.model.name!r}"
        self.info["xfuser_runner"] = f"{self.model.name} ({self.runner_class.__name__}), our weights"
        return None

    def apply(self, b: Bench) -> None:
        self._setup(b)
        from xfuser import xFuserArgs

        kwargs = b.call_kwargs(b.prompts[0], b.steps)
        config = xFuserArgs(model=self.runner_class.settings.model_name, ulysses_degree=b.world_size, ring_degree=1,
                            use_torch_compile=self.compile, height=b.height, width=b.width,
                            num_frames=kwargs.get("num_frames") or 1, num_inference_steps=b.steps, seed=b.args.seed)
        vae = getattr(b.pipe, "vae", None)
        # What the runner changes outside its own modules: the VAE's options, Inductor's global overlap passes.
        self.saved = {"vae_flags": {k: getattr(vae, k) for k in ("use_tiling", "use_slicing") if hasattr(vae, k)},
                      "inductor": _inductor_overlap_config()}
        self.runner = _in_memory_runner(self.runner_class, self.transformer_class)(config, b.pipe)
        self.flow_shift = getattr(b.pipe.scheduler.config, "flow_shift", None)
        # Loads (our components), sets up xfuser's runtime state, and with compile: compiles and runs its warm-up.
        self.runner.initialize(runner_input_args(kwargs, b.args.seed, self.flow_shift))
        if self.compile:
            self.info["compile_mode"] = (f"xfuser use_torch_compile (its runner: torch.compile of the transformer, "
                                         f"mode {self.runner._get_compile_mode()})")
        from xfuser.core.distributed import get_runtime_state

        backend = getattr(get_runtime_state(), "attention_backend", None)
        if backend is not None:
            self.info["xfuser_attention_backend"] = str(backend)

    def timed_module(self, b: Bench) -> torch.nn.Module:
        return self.runner.pipe.transformer

    def call(self, b: Bench, kwargs: dict):
        args = runner_input_args(kwargs, b.args.seed, self.flow_shift)
        # What the runner's own _run_pipe does before each pipeline call.
        self.runner.prepare_run(args)
        if self.model.sets_input_parameters:
            from xfuser.core.distributed import get_pipeline_parallel_world_size, get_runtime_state

            get_runtime_state().set_input_parameters(
                batch_size=1, num_inference_steps=args["num_inference_steps"],
                max_condition_sequence_length=args["max_sequence_length"],
                split_text_embed_in_sp=get_pipeline_parallel_world_size() == 1)
        return self.runner.pipe(**kwargs)

    def restore(self, b: Bench) -> None:
        for key, value in self.saved.get("vae_flags", {}).items():
            setattr(b.pipe.vae, key, value)
        if "inductor" in self.saved:
            _set_inductor_overlap_config(self.saved["inductor"])
        self.saved, self.runner = {}, None
        if self.compile:
            torch._dynamo.reset()


_OVERLAP_KEYS = ("reorder_for_compute_comm_overlap", "reorder_for_compute_comm_overlap_passes")


def _inductor_overlap_config() -> dict:
    """Inductor's compute/communication overlap settings, which an xfuser runner's compile sets process-wide."""
    import torch._inductor.config as inductor

    return {key: copy.copy(getattr(inductor, key)) for key in _OVERLAP_KEYS if hasattr(inductor, key)}


def _set_inductor_overlap_config(values: dict) -> None:
    import torch._inductor.config as inductor

    for key, value in values.items():
        setattr(inductor, key, value)


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
            _share_buffers(wrapper, ours)
            wrapper.to(device=ours.device)  # its own buffers (Wan's head_perm): the rest are ours, already there
            wrapper.eval()
            return rebuilt_pipeline(self._ours, transformer=wrapper)

    _InMemoryRunner.__name__ = f"InMemory{runner_class.__name__}"
    return _InMemoryRunner


def _share_buffers(wrapper: torch.nn.Module, ours: torch.nn.Module) -> None:
    """Every buffer `wrapper` has under the same name as `ours` (non-persistent ones too: rotary tables, which the
    state dict leaves out) becomes ours: the same values in the same dtype, where a fresh one would be float32."""
    theirs = dict(ours.named_buffers())
    for name, _ in list(wrapper.named_buffers()):
        if name in theirs:
            owner, _, leaf = name.rpartition(".")
            wrapper.get_submodule(owner)._buffers[leaf] = theirs[name]

