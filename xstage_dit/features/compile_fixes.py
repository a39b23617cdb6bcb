"""Work-arounds for torch.compile failures in diffusers DiT layers; `parallelize` applies them, `restore` undoes them.

grouped_mm offsets (NucleusMoE): diffusers' ``SwiGLUExperts._run_experts_grouped_mm`` builds the offsets
as ``torch.cumsum(num_tokens_per_expert, 0, dtype=torch.int32)`` where ``num_tokens_per_expert`` is a
``torch.full`` of the layer. Inductor's ``pointless_cumsum_replacement`` pass rewrites ``cumsum(full(...))``
and drops cumsum's ``dtype`` (pytorch/pytorch#189518; seen with torch 2.11 on the H200 and 2.13 on the
CPU), so the compiled ``grouped_mm`` gets int64 offsets and raises "Offsets tensor must be integer (int32)
tensor, but got torch.int64". That breaks ``torch.compile`` of every NucleusMoE pipeline, plain diffusers
included (benchmarks/results/e2e-1xh200-notes.md). The replacement takes the same cumsum in int64 and
casts explicitly: the same offsets, the same grouped matmuls, in the same order as diffusers.
"""

from __future__ import annotations

import logging
import types
from typing import Callable

import torch
import torch.nn.functional as F

from xstage_dit.families.registry import grouped_mm_expert_classes
from xstage_dit.features.context import chained

log = logging.getLogger(__name__)


def _run_experts_grouped_mm(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """diffusers' ``SwiGLUExperts._run_experts_grouped_mm`` with compile-safe offsets.

    x: (tokens, hidden) sorted by expert; num_tokens_per_expert: (num_experts,) integer. Returns
    (tokens, hidden) in x.dtype: ``(silu(x @ gate) * (x @ up)) @ down`` per expert.
    """
    offsets = torch.cumsum(num_tokens_per_expert, dim=0).to(torch.int32)  # exclusive ends, int32 for grouped_mm
    gate_up = F.grouped_mm(x, self.gate_up_proj, offs=offsets)
    gate, up = gate_up.chunk(2, dim=-1)
    out = F.grouped_mm(F.silu(gate) * up, self.down_proj, offs=offsets)
    return out.type_as(x)


def fix_grouped_mm_offsets(model: torch.nn.Module) -> tuple[Callable[[], None], int]:
    """Give every diffusers ``SwiGLUExperts`` of `model` the compile-safe grouped-matmul path (an
    instance attribute: the class and other models are untouched). Returns (undo, modules fixed)."""
    fixed = []
    classes = grouped_mm_expert_classes()  # NucleusMoE's SwiGLUExperts (its family record)
    for module in model.modules():
        if type(module).__name__ in classes and hasattr(type(module), "_run_experts_grouped_mm"):
            module._run_experts_grouped_mm = types.MethodType(_run_experts_grouped_mm, module)
            fixed.append(module)
    if fixed:
        log.info("compile fix: %d SwiGLUExperts take int64 cumsum + cast for grouped_mm offsets "
                 "(Inductor drops cumsum's dtype, pytorch/pytorch#189518)", len(fixed))

    def undo() -> None:
        for module in fixed:
            module.__dict__.pop("_run_experts_grouped_mm", None)
        fixed.clear()

    return undo, len(fixed)


def apply(pipe, config, ctx) -> Callable[[], None] | None:
    """The stack's compile fixes: `fix_grouped_mm_offsets` on each transformer (its MoE layers that stayed
    diffusers' own after expert parallelism)."""
    return chained(fix_grouped_mm_offsets(transformer)[0] for transformer in ctx.transformers)
