"""`FeatureContext`: what the feature stack hands each feature, and what a feature leaves for later ones.

A feature never reads another feature's marker attribute: what one needs from another (the attention schedules
the sequence-parallel backend uses, the CFG hooks the decode check watches, the one-frame decode compile
compiles, the kernel chooser CUDA graphs restrict) travels here, set by the feature that makes it and read by
the ones after it in the stack's declared order (`features.stack.ORDER`).

The stack marks each transformer it patched with itself (`MARK`): that is how ``parallelize`` refuses a
pipeline patched twice, and how the standalone entry points (`compile.apply_compile` after ``parallelize``)
get the context the stack built (`context_of`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from xstage_dit.features.config import ParallelConfig

MARK = "_xstage_parallel_handle"  # on every transformer the stack patched: the stack (its `ctx` is the context)

# The components a pipeline's denoise loop calls: pipe.transformer; pipe.transformer_2, a second expert (Wan 2.2
# A14B); pipe.transformer_ref, the ref2va checkpoint partition of MiniMax-H3's modular pipeline (one repository,
# two transformers; a workflow loads only its own, so either may be None).
DENOISERS = ("transformer", "transformer_2", "transformer_ref")

# diffusers' cache-context names of the branch a transformer forward computes (the pipelines' own "cond" and
# "uncond"; PAIR_CONTEXT: one forward on a batch of both, cond first). The CFG hooks run each forward under its
# branch's name; the step cache's per-branch state and its group decision read it (`features.step_cache.gate`).
COND_CONTEXT, UNCOND_CONTEXT, PAIR_CONTEXT = "cond", "uncond", "cond+uncond"


def transformers_of(pipe: Any) -> list[torch.nn.Module]:
    """Every denoiser component of `pipe` that is loaded (`DENOISERS`, in that order), or [pipe] for a bare
    transformer. A diffusers ModularPipeline exposes its components as attributes, so it is taken like a
    DiffusionPipeline. ValueError for anything else."""
    found = [m for m in (getattr(pipe, name, None) for name in DENOISERS) if isinstance(m, torch.nn.Module)]
    if found:
        return found
    if isinstance(pipe, torch.nn.Module):
        return [pipe]  # a bare transformer
    raise ValueError(f"expected a diffusers pipeline with a .transformer (a DiT pipeline), got {type(pipe).__name__}")


def modules_of(pipe: Any) -> list[torch.nn.Module]:
    """The transformers of `pipe` without raising (what the ranks compare before validating)."""
    try:
        return transformers_of(pipe)
    except ValueError:
        return []


def chained(undos: Iterable[Callable[[], None] | None]) -> Callable[[], None] | None:
    """One undo running `undos` in reverse (idempotent); None when there is nothing to undo. `undos` may be a
    generator that applies as it goes: if applying one raises, the undos collected so far run, then it re-raises."""
    pending: list[Callable[[], None]] = []
    try:
        for undo in undos:
            if undo is not None:
                pending.append(undo)
    except BaseException:
        while pending:
            pending.pop()()
        raise
    if not pending:
        return None

    def undo() -> None:
        while pending:
            pending.pop()()

    return undo


@dataclass(eq=False)
class FeatureContext:
    """One pipeline's stack state, shared by its features (module docstring).

    Set up by the stack before any feature: pipe, transformers, parallel (the ParallelConfig; None where no
    parallel feature runs), groups (`ParallelGroups`), plans (each transformer's `ModelPlan`), calibration (the
    ``ChosenParams`` the schedules use, None where the user fixed the schedule), comm (the `CommBuffers` the
    ops of these groups allocate into). Left by features for later ones and for reports: schedules / attention
    kernels / schedule_choices / attention_paths (attention kernel choice), num_moe_layers (expert parallel),
    cfg_hooks (CFG parallel and CFG batch, read by the decode check), cfg_batch_reason, text_layers_skipped
    (text depth), prompt_cache, vae_convs_2d / one_frame_decode (one-frame VAE, read by compile),
    batch_invariance (its handle), lora (the `LoraManager`: its graph variants, read by compile), compiled (the
    `CompileHandle`), step_cache (the `StepCacheHandle`) and compile_inside (what a cache hook calls when it
    computes, each with its ``module`` and a ``fn`` the compile feature swaps for a compiled one, the hook itself
    kept out of the graphs).
    """

    pipe: Any
    transformers: list = field(default_factory=list)
    parallel: ParallelConfig | None = None
    groups: Any = None
    plans: list = field(default_factory=list)
    calibration: Any = None
    comm: Any = None
    schedules: Any = None
    attention_kernels: Any = None
    schedule_choices: dict = field(default_factory=dict)
    masked_choices: dict = field(default_factory=dict)
    attention_paths: dict = field(default_factory=dict)
    num_moe_layers: int = 0
    cfg_hooks: list = field(default_factory=list)
    cfg_batch_reason: str = ""
    text_layers_skipped: bool = False
    prompt_cache: Any = None
    vae_convs_2d: int = 0
    one_frame_decode: Any = None
    batch_invariance: Any = None
    lora: Any = None
    compiled: Any = None
    fp8: list = field(default_factory=list)
    step_cache: Any = None
    compile_inside: list = field(default_factory=list)

    @property
    def is_pipeline(self) -> bool:
        """False for a bare transformer (no text encoder or VAE: the pipeline-level features skip it)."""
        return not isinstance(self.pipe, torch.nn.Module)


def stack_of(pipe: Any) -> Any:
    """The stack that patched `pipe`'s transformer (or the bare transformer `pipe`), or None."""
    modules = modules_of(pipe)
    return getattr(modules[0], MARK, None) if modules else None


def context_of(pipe: Any) -> FeatureContext:
    """The context of the stack that patched `pipe`, or a fresh one for an unpatched pipeline (nothing applied:
    no schedules, no CFG hooks, no one-frame decode)."""
    stack = stack_of(pipe)
    return stack.ctx if stack is not None else FeatureContext(pipe=pipe, transformers=modules_of(pipe))
