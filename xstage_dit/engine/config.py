"""`EngineConfig`: everything that decides what runs, for one pipeline, in one validated value.

The model and where it runs (``model``, ``device``, ``dtype``, ``weights_seed``), the parallel degrees
(``parallel``: a `ParallelConfig`), the compile options (``compile``: a `CompileConfig`, None for the device's
default) and one switch per feature of the stack (`features.stack.FEATURES`). ``stack_config(kind)`` is the
`StackConfig` the feature stack applies; nothing below it re-derives a default.

    config = EngineConfig(model="tiny-flux", parallel=ParallelConfig(sp=2), compile=CompileConfig("regional"))
    config.stack_config("image")      # what the stack applies to that pipeline
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from xstage_dit.features.compile import CompileConfig, default_compile_mode
from xstage_dit.features.config import ParallelConfig
from xstage_dit.features.fp8 import FP8_ATTENTION, GRANULARITIES, Fp8Config, refuse_fp8_with_lora
from xstage_dit.features.lora import LoraServingConfig
from xstage_dit.features.lora.config import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, DEFAULT_PER_REQUEST
from xstage_dit.features.stack import StackConfig
from xstage_dit.features.step_cache import StepCacheConfig

__all__ = ["EngineConfig", "DTYPES", "KINDS", "QUANTIZE"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KINDS = ("image", "video")
QUANTIZE = ("none", "fp8")
_FLAGS = ("host_syncs", "text_depth", "prompt_cache", "one_frame_vae")


def _device(value) -> torch.device:
    if value is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"expected a device cpu, cuda or cuda:N, got {value!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"expected a device cpu, cuda or cuda:N, got {value!r}")
    return device


@dataclass(frozen=True)
class EngineConfig:
    """One pipeline's configuration (validated on construction; bad values raise ValueError naming them).

    model: a built-in model name (``xstage_dit.families.model_names()``) or a local diffusers folder; None when
        the pipeline is handed to `Engine.apply` instead of loaded.
    device: torch device (str or torch.device); None: cuda where present, else cpu. Normalised on construction.
    dtype: weights and compute dtype (a torch dtype or its name); None: bfloat16 on a GPU, float32 on a CPU.
    weights_seed: seed of a built-in model's random weights (not of the images: calls carry their seeds).
    parallel: the `ParallelConfig` (world 1 by default: the measured attention kernel, MoE layers per kind);
        None: no parallel feature at all (no groups, no calibration).
    compile: a `CompileConfig`; None: the device's default mode (regional on a GPU, off on a CPU).
    batch_invariance: True, False, or "auto" (on for image pipelines, which a server batches).
    host_syncs / text_depth / prompt_cache / one_frame_vae: those features on (default) or off.
    quantize: "none" (weights as loaded) or "fp8" (the transformer's linear layers in float8: `features.fp8`).
    fp8_granularity: with quantize "fp8", one of `features.fp8.GRANULARITIES` ("row": per-token x per-channel).
    fp8_attention: with quantize "fp8", one of `features.fp8.FP8_ATTENTION`: "off" (default), "auto" (the 8-bit
        attention kernels join the attention kernel sweep, chosen per shape where faster) or a kernel's name.
    lora_dir: the folder of LoRA adapters requests may name (`features.lora`); None: none from a folder.
    max_loras / max_lora_rank / max_loras_per_request: resident adapters (LRU past it), the largest rank (the slots'
        rank when compiled), adapters one call may combine.
    preload_loras: adapters loaded at start-up: names in lora_dir, or paths of adapter files or folders (named by
        file stem). LoRA is on when lora_dir or preload_loras is given; compiled, adapters are hot-swapped.
    lora_mode: how a request's adapters run: "auto" (default), "fused" (merged into the weights) or "unfused"
        (`features.lora.LoraServingConfig.mode`).
    cache: a `features.step_cache.StepCacheConfig` (one of diffusers' step caches, one decision for all ranks);
        None: no step cache.
    """

    model: str | None = None
    device: torch.device | str | None = None
    dtype: torch.dtype | str | None = None
    weights_seed: int = 0
    parallel: ParallelConfig | None = field(default_factory=ParallelConfig)
    compile: CompileConfig | None = None
    batch_invariance: bool | str = "auto"
    host_syncs: bool = True
    text_depth: bool = True
    prompt_cache: bool = True
    one_frame_vae: bool = True
    quantize: str = "none"
    fp8_granularity: str = "row"
    fp8_attention: str = "off"
    lora_dir: str | None = None
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_loras_per_request: int = DEFAULT_PER_REQUEST
    preload_loras: tuple[str, ...] = ()
    lora_mode: str = "auto"
    cache: StepCacheConfig | None = None

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"expected model to be a model name or a folder path, got {self.model!r}")
        device = _device(self.device)
        object.__setattr__(self, "device", device)
        dtype = self.dtype
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        elif isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ValueError(f"expected dtype in {', '.join(DTYPES)}, got {dtype!r}")
            dtype = DTYPES[dtype]
        if dtype not in DTYPES.values():
            raise ValueError(f"expected dtype in {', '.join(DTYPES)}, got {dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        if not isinstance(self.weights_seed, int) or isinstance(self.weights_seed, bool) or self.weights_seed < 0:
            raise ValueError(f"expected weights_seed to be an integer >= 0, got {self.weights_seed!r}")
        if self.parallel is not None and not isinstance(self.parallel, ParallelConfig):
            raise ValueError(f"expected parallel to be a ParallelConfig or None, got {type(self.parallel).__name__}")
        if self.compile is None:
            object.__setattr__(self, "compile", CompileConfig(default_compile_mode(device)))
        elif not isinstance(self.compile, CompileConfig):
            raise ValueError(f"expected compile to be a CompileConfig or None, got {type(self.compile).__name__}")
        if self.batch_invariance not in (True, False, "auto"):
            raise ValueError(f"expected batch_invariance True, False or 'auto', got {self.batch_invariance!r}")
        if self.quantize not in QUANTIZE:
            raise ValueError(f"expected quantize in {', '.join(QUANTIZE)}, got {self.quantize!r}")
        if self.fp8_granularity not in GRANULARITIES:
            raise ValueError(f"expected fp8_granularity in {', '.join(GRANULARITIES)}, got {self.fp8_granularity!r}")
        if self.fp8_attention not in FP8_ATTENTION:
            raise ValueError(f"expected fp8_attention in {', '.join(FP8_ATTENTION)}, got {self.fp8_attention!r}")
        if self.fp8_attention != "off" and self.quantize != "fp8":
            raise ValueError(f"expected quantize 'fp8' with fp8_attention {self.fp8_attention!r} (FP8 attention is part "
                             f"of the FP8 mode), got quantize {self.quantize!r}")
        refuse_fp8_with_lora(self.quantize, self.lora_dir is not None or bool(self.preload_loras))
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"expected {name} to be True or False, got {getattr(self, name)!r}")
        if self.cache is not None and not isinstance(self.cache, StepCacheConfig):
            raise ValueError(f"expected cache to be a StepCacheConfig or None, got {type(self.cache).__name__}")
        object.__setattr__(self, "preload_loras", tuple(self.preload_loras))
        self.lora_config()  # a bad LoRA option fails here, naming it

    def lora_config(self) -> LoraServingConfig | None:
        """The LoRA feature's config (None without lora_dir and preload_loras). A preload entry that is a path
        becomes an adapter named by its file stem."""
        if self.lora_dir is None and not self.preload_loras:
            return None
        paths, names = {}, []
        for entry in self.preload_loras:
            if os.sep in entry or os.path.exists(entry):
                name = os.path.basename(os.path.normpath(entry)).removesuffix(".safetensors")
                paths[name] = entry
                names.append(name)
            else:
                names.append(entry)
        return LoraServingConfig(lora_dir=self.lora_dir, paths=paths, max_loras=self.max_loras,
                                 max_lora_rank=self.max_lora_rank, preload=tuple(names),
                                 max_per_request=self.max_loras_per_request, hotswap=self.compile.mode != "off",
                                 mode=self.lora_mode)

    def expert_shard(self, rank: int) -> tuple[int, int] | None:
        """The experts rank `rank` loads (`ParallelConfig.expert_shard`); None without expert parallelism."""
        return None if self.parallel is None else self.parallel.expert_shard(rank)

    def stack_config(self, kind: str) -> StackConfig:
        """The `StackConfig` for a pipeline of `kind` ("image" or "video": batch invariance "auto" is on for
        images, whose calls a server batches; a video runs alone)."""
        if kind not in KINDS:
            raise ValueError(f"expected kind 'image' or 'video', got {kind!r}")
        invariant = kind == "image" if self.batch_invariance == "auto" else self.batch_invariance
        fp8 = Fp8Config(self.fp8_granularity, attention=self.fp8_attention) if self.quantize == "fp8" else None
        return StackConfig(parallel=self.parallel, compile=self.compile, batch_invariance=invariant, fp8=fp8,
                           lora=self.lora_config(), cache=self.cache,
                           **{name: getattr(self, name) for name in _FLAGS})
