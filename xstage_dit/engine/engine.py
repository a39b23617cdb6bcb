"""`Engine`: one pipeline and the feature stack applied to it, from one `EngineConfig`.

What ``xstage-dit generate``, ``xstage-dit serve`` (every rank's loader) and ``xstage-dit bench`` (the xstage
contenders) run: the pipeline loaded through `xstage_dit.families.load_pipeline` (a built-in name or a local
diffusers folder), then every feature in the stack's one declared order (`features.stack.ORDER`: parallelism,
the pipeline patches, batch invariance, compile last), with one undo stack. ``restore()`` gives the pipeline
and the process back as they were: no hook, enum member, process-wide swap, compiled graph or communication
buffer left.

    engine = Engine(EngineConfig(model="tiny-flux"))
    pipe = engine.load()                  # or engine.apply(my_pipe, kind="image") for a pipeline of your own
    engine.apply(pipe)
    image = pipe("a red fox", num_inference_steps=4).images[0]
    engine.restore()
"""

from __future__ import annotations

import logging
from typing import Any

from xstage_dit.engine.config import KINDS, EngineConfig
from xstage_dit.features import apply_stack
from xstage_dit.features.compile import CompileConfig, compile_pipeline

log = logging.getLogger(__name__)

__all__ = ["Engine"]


class Engine:
    """One pipeline's engine. config: the `EngineConfig`; rank: this process's global rank (which experts it
    loads with expert parallelism). After `apply`: ``pipe``, ``stack`` (the `FeatureStack`: ``describe_pipeline()``,
    ``schedule_choices``, ``attention_kernels``, ``calibration``, ``compiled``, ``batch_invariance`` ...) and
    ``kind``."""

    def __init__(self, config: EngineConfig, *, rank: int = 0) -> None:
        if not isinstance(config, EngineConfig):
            raise ValueError(f"expected an EngineConfig, got {type(config).__name__}")
        self.config = config
        self.rank = rank
        self.pipe: Any = None
        self.stack: Any = None
        self.kind: str | None = None

    @property
    def expert_shard(self) -> tuple[int, int] | None:
        """The experts this rank loads: (EP-group rank, ep) with expert parallelism, else None (all)."""
        return self.config.expert_shard(self.rank)

    def spec(self) -> Any:
        """The model's `ModelSpec` (`families.model_spec`); ValueError naming a model that is neither built in
        nor a diffusers folder."""
        from xstage_dit.families import model_spec

        if self.config.model is None:
            raise ValueError("expected EngineConfig.model to load a pipeline, got None (hand one to apply())")
        return model_spec(self.config.model)

    def load(self) -> Any:
        """The configured model's pipeline on the configured device and dtype (this rank's experts only with
        expert parallelism). ValueError naming what the model refuses (an expert shard, a folder)."""
        from xstage_dit.families import load_pipeline

        self.spec()  # names a bad model before anything is built
        return load_pipeline(self.config.model, dtype=self.config.dtype, device=self.config.device,
                             seed=self.config.weights_seed, expert_shard=self.expert_shard)

    def apply(self, pipe: Any, kind: str | None = None) -> Any:
        """Apply the configured stack to `pipe`; kind ("image" / "video"): the pipeline's kind, taken from the
        model's spec when None. Returns the `FeatureStack` (also ``self.stack``). RuntimeError if this engine
        holds a stack already: restore() first."""
        if self.stack is not None:
            raise RuntimeError("expected an engine without an applied stack, got one: restore() first")
        kind = self.spec().kind if kind is None else kind
        if kind not in KINDS:
            raise ValueError(f"expected kind 'image' or 'video', got {kind!r}")
        self.stack = apply_stack(pipe, self.config.stack_config(kind))
        self.pipe, self.kind = pipe, kind
        return self.stack

    @classmethod
    def start(cls, config: EngineConfig, *, rank: int = 0) -> "Engine":
        """``Engine(config, rank=rank)``, its model loaded and the stack applied."""
        engine = cls(config, rank=rank)
        engine.apply(engine.load())
        return engine

    def describe(self) -> dict:
        """What the stack did so far: compile (`CompileHandle.describe`), batch invariance, the patches outside
        the transformer, the features applied in order. {} before `apply`."""
        stack = self.stack
        if stack is None:
            return {}
        compiled, invariance = stack.compiled, stack.batch_invariance
        if compiled is None:  # compile off: what the compile feature reports when it compiles nothing
            compiled = compile_pipeline(self.pipe, CompileConfig("off", self.config.compile.max_shapes), stack.ctx)
        return {"features": list(stack.applied), "compile": compiled.describe(),
                "batch_invariance": invariance.describe() if invariance is not None else None,
                "fp8": [handle.describe() for handle in stack.fp8] or None,
                "step_cache": stack.step_cache.describe() if stack.step_cache is not None else None,
                "outside_transformer": stack.describe_pipeline()}

    # ----- LoRA (the stack's `features.lora` manager; the server's /v1/loras and request field do the same) -----
    @property
    def lora(self) -> Any:
        """The `LoraManager` of the applied stack; ValueError when LoRA is off (no lora_dir / preload_loras)."""
        manager = getattr(self.stack, "lora", None) if self.stack is not None else None
        if manager is None:
            raise ValueError("expected an engine with LoRA on (EngineConfig.lora_dir or preload_loras) and applied, "
                             "got none")
        return manager

    def loras(self) -> list[dict]:
        """Every adapter that can be served: name, resident, active scale, rank and digest where resident."""
        return self.lora.describe()

    def load_lora(self, name: str) -> Any:
        """Make adapter `name` resident (LRU eviction past max_loras); its checked `AdapterFile`."""
        return self.lora.load(name)

    def activate_loras(self, adapters) -> tuple:
        """The adapters of the next pipeline calls: ``[(name, scale), ...]``, names, or None for none."""
        return self.lora.activate(adapters)

    def restore(self) -> None:
        """Undo the stack (reverse order) and forget the pipeline. Safe to call twice."""
        stack, self.stack = self.stack, None
        if stack is not None:
            stack.restore()
        self.pipe = self.kind = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
