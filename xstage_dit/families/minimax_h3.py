"""MiniMax-H3 text-to-video+audio: diffusers 0.42.1 ships it as a modular pipeline only (``MiniMaxH3Blocks``,
no ``DiffusionPipeline`` class), so `generate` and `serve` do not run it; `parallelize` takes it from Python
(``pipe.transformer``, and ``pipe.transformer_ref`` of the ref2va workflow). Guidance-distilled: one transformer
call per step on a batch of 1, no CFG to parallelize. No built-in model here: the CPU tests build a tiny one
(``tests/helpers/minimax_h3.py``).

The plan: diffusers' own (the packed ``[text | keyframes | audio | video]`` sequence is split at the first
block, with the per-row rotary table, AdaLN rows and ``norm_out`` timestep rows; both output heads gather),
completed: the token refiner attends the whole prompt inside the forward, before that split, so its attention
is local. Routed through the sequence-parallel backend it would take every rank's copy of the same prompt as a
shard of a world-times longer one: the same numbers (every key duplicated alike) for a collective and world
times the attention work per refiner layer.
"""

from __future__ import annotations

import torch

from xstage_dit import _diffusers_private as private
from xstage_dit.families.record import FamilyRecord, SequenceParallelFacts
from xstage_dit.families.sp_plan import SequenceParallelSpec, blocks_of

_SHIPPED_ENTRIES = {"rope", "transformer_blocks.0", "transformer_blocks.*", "norm_out", "proj_out", "audio_proj_out"}


def sequence_plan(model: torch.nn.Module) -> SequenceParallelSpec:
    """diffusers' plan with the token refiner local; ValueError if the shipped plan names other modules."""
    shipped = private.shipped_cp_plan(type(model)) or {}
    if set(shipped) != _SHIPPED_ENTRIES:
        raise ValueError(f"expected MiniMax-H3's _cp_plan to name {sorted(_SHIPPED_ENTRIES)}, got {sorted(shipped)}")
    blocks_of(model, "transformer_blocks")
    return SequenceParallelSpec(cp_plan=dict(shipped), local_attention=("token_refiner.*",))


RECORD = FamilyRecord(
    name="minimax-h3", title="MiniMax-H3", kind="video",
    pipelines={},
    transformers=("MiniMaxH3Transformer3DModel",),
    sp=SequenceParallelFacts(plan_source="diffusers (completed: token refiner local)", build=sequence_plan, cfg=None),
    real_weights_example="MiniMax-H3", pipeline_worlds=(2, 4),
)
