"""Torch custom ops of the attention (``torch.library.custom_op`` + ``register_fake``), so that
``torch.compile`` can trace a patched model and CUDA graphs see a single op. The MoE ops are registered in
``xstage_dit.ops.moe.custom_ops``; group names live in ``xstage_dit.comm.group_names``.

To add an op: write its eager implementation in its own module, then here a ``custom_op`` wrapper
taking only tensors and plain values, its fake (shape/dtype only), and a thin public caller.
Process groups cannot cross the op boundary, so callers pass ``group_name(group)`` and the wrapper
resolves it with ``resolve_group``.
"""

from __future__ import annotations

import torch

from xstage_dit.comm.group_names import group_name, resolve_group  # noqa: F401  (callers still import them here)

NAMESPACE = "xstage_dit"


# ------------------------------------------------------------------------------- ulysses_attention


@torch.library.custom_op(f"{NAMESPACE}::ulysses_attention", mutates_args=())
def _ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: str, schedule: str,
                       scale: float | None, seq_len: int | None) -> torch.Tensor:
    from xstage_dit.ops.attention.op import ulysses_attention_impl

    return ulysses_attention_impl(q, k, v, group=resolve_group(group), schedule=schedule, scale=scale, seq_len=seq_len)


@_ulysses_attention.register_fake
def _(q, k, v, group, schedule, scale, seq_len):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def ulysses_attention_op(q, k, v, *, group=None, schedule="auto", scale=None, seq_len=None) -> torch.Tensor:
    """Call ``xstage_dit::ulysses_attention`` (arguments as ``ops.ulysses_attention.ulysses_attention``)."""
    return torch.ops.xstage_dit.ulysses_attention(q, k, v, group_name(group), schedule,
                                                  None if scale is None else float(scale), seq_len)

