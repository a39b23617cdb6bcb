"""Expert-choice routing agreement for `bench_fp8_error` (NucleusMoE): which tokens each expert picked in a run, and
the share of a variant's picks the fp32 reference made too.

Why: NucleusMoE's bf16 latents were 0.48 (relative L2) from fp32 on the H100, 14x Wan's, and the tiny model on the
CPU gives 0.0039. diffusers' ``NucleusMoELayer`` rounds its router's scores to the model dtype before each expert
takes its top-C tokens, so bf16 can tie and reorder tokens that fp32 tells apart. Counting the moved picks says
whether routing explains that error (and FP8's, read against it).
"""

from __future__ import annotations

import contextlib
import math
from functools import partial
from typing import Iterator

import torch
import torch.nn.functional as F


def expert_choice_layers(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The expert-choice MoE layers of `transformer`: diffusers' ``NucleusMoELayer`` (a ``gate`` linear, a
    ``capacity_factor``, ``num_experts`` and ``use_sigmoid``)."""
    return [m for m in transformer.modules()
            if type(m).__name__ == "NucleusMoELayer" and all(hasattr(m, a) for a in
                                                             ("gate", "capacity_factor", "num_experts", "use_sigmoid"))]


def _pick(layer: torch.nn.Module, picks: list, _gate, _args, logits: torch.Tensor) -> None:
    # diffusers' NucleusMoELayer.forward, from its gate's logits to its top-k: scores in float32, rounded to the
    # logits' dtype, then each expert's top-C tokens.
    scores = torch.sigmoid(logits.float()) if layer.use_sigmoid else F.softmax(logits.float(), dim=-1)
    tokens = logits.shape[1]
    capacity = max(1, math.ceil(layer.capacity_factor * tokens / layer.num_experts))
    chosen = torch.topk(scores.to(logits.dtype).transpose(1, 2), k=capacity, dim=-1).indices
    picks.append((chosen.to("cpu", torch.int32), tokens))


@contextlib.contextmanager
def recorded_picks(transformer: torch.nn.Module) -> Iterator[list[tuple[torch.Tensor, int]]]:
    """Yields a list that fills, in call order, with each expert-choice layer call's picks: ((batch, experts,
    capacity) int32 token indices, tokens in the sequence). Empty for a transformer without such layers."""
    picks: list[tuple[torch.Tensor, int]] = []
    hooks = [layer.gate.register_forward_hook(partial(_pick, layer, picks))
             for layer in expert_choice_layers(transformer)]
    try:
        yield picks
    finally:
        for hook in hooks:
            hook.remove()


def agreement(picks: list[tuple[torch.Tensor, int]], reference: list[tuple[torch.Tensor, int]]) -> float | None:
    """The share of the (layer call, sample, expert, token) picks in `picks` that `reference` made too; None where
    either recorded none or their calls do not pair up (another number or shape of layer calls)."""
    if not picks or len(picks) != len(reference):
        return None
    same = total = 0
    for (a, tokens), (b, tokens_ref) in zip(picks, reference):
        if a.shape != b.shape or tokens != tokens_ref:
            return None
        mask = torch.zeros(*a.shape[:2], tokens, dtype=torch.bool)
        mask.scatter_(-1, b.long(), True)
        same += int(mask.gather(-1, a.long()).sum())
        total += a.numel()
    return same / total
