"""SwiGLU expert MLPs in FP8 on torch's grouped FP8 GEMM (private API: ``_torch_private.scaled_grouped_mm``, Hopper
and newer).

    gate_up = x @ W_gu[e];  h = silu(gate) * up;  out = h @ W_d[e]      for the rows of expert e

Weights (quantized once, `quantize_expert_weight`): e4m3 with one power-of-two scale per (expert, output column)
(row-wise along the contraction, as torchao's row-wise FP8 linear layers), stored (E, N, K) and handed over as
its (E, K, N) column-major view, the layout the grouped GEMM takes. Activations (`quantize_rows`, per call): e4m3
with one power-of-two scale per row (token), computed on the fly; under ``torch.compile`` the amax, scale and cast
fuse into the neighbouring kernels. Output in bf16. The scales are fp8_reference's rule (exact powers of two).

The SwiGLU between the two GEMMs (`swiglu`) runs in fp32 and goes to e4m3 without a bf16 rounding in between:
Inductor keeps a fused pointwise chain in fp32 anyway, so a bf16 intermediate in eager made eager and compiled
quantize different numbers (rel L2 0.016-0.017 between them on an H100, 0.011 on a CPU, 2026-12-07); in fp32 both
quantize the same values (bit for bit on a CPU).

`fp8_swiglu_experts` is the fast path; `fp8_swiglu_experts_emulated` the same roundings in fp32 with per-expert
matmuls (its definition: CPU tests, and the GPU test's yardstick).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xstage_dit import _torch_private as tp
from xstage_dit.ops.attention.fp8_reference import E4M3, po2_scale
from xstage_dit.ops.capability import capability_refusal

__all__ = ["fp8_swiglu_experts", "fp8_swiglu_experts_emulated", "grouped_fp8_unavailable", "quantize_expert_weight",
           "quantize_rows", "swiglu"]


def grouped_fp8_unavailable(device: torch.device) -> str | None:
    """Why torch's grouped FP8 GEMM cannot run on ``device``, or None (it is built for Hopper and newer)."""
    refusal = capability_refusal(device, (9, 0), "the grouped FP8 GEMM")
    if refusal:
        return refusal
    if not tp.has_scaled_grouped_mm():
        return f"torch {torch.__version__} has no grouped FP8 GEMM (or is outside the tested range)"
    return None


def quantize_expert_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: (E, K, N) (x @ w[e] per expert) -> (e4m3 (E, K, N) column-major view of an (E, N, K) tensor, descale
    (E, N) fp32): one scale per expert and output column."""
    if w.dim() != 3:
        raise ValueError(f"expected expert weights (experts, in, out), got {tuple(w.shape)}")
    rows = w.detach().transpose(1, 2)  # (E, N, K): one row per output column
    scale = po2_scale(rows.abs().amax(dim=-1))
    w8 = (rows.float() * scale[..., None]).to(E4M3).contiguous()
    return w8.transpose(1, 2), (1.0 / scale).contiguous()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (M, K) -> (e4m3 (M, K) row-major, descale (M,) fp32): one scale per row."""
    scale = po2_scale(x.detach().abs().amax(dim=-1, keepdim=True))
    return (x.float() * scale).to(E4M3), (1.0 / scale).squeeze(-1)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """h: (M, 2 inter) -> silu(gate) * up (M, inter) in fp32 (module docstring: why not in h's dtype)."""
    gate, up = h.float().chunk(2, dim=-1)
    return F.silu(gate) * up


def _offsets(num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    # int64 cumsum then a cast: Inductor drops cumsum's dtype argument (features/compile_fixes.py)
    return torch.cumsum(num_tokens_per_expert, dim=0).to(torch.int32)


def fp8_swiglu_experts(x: torch.Tensor, num_tokens_per_expert: torch.Tensor, gate_up: tuple[torch.Tensor, torch.Tensor],
                       down: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x: (tokens, hidden) bf16, rows sorted by expert; num_tokens_per_expert: (E,) integer; gate_up / down: the
    `quantize_expert_weight` pairs of (E, hidden, 2 inter) / (E, inter, hidden) -> (tokens, hidden) in x's dtype."""
    offsets = _offsets(num_tokens_per_expert)
    x8, x_descale = quantize_rows(x)
    h = tp.scaled_grouped_mm(x8, gate_up[0], x_descale, gate_up[1], offsets=offsets, out_dtype=torch.bfloat16,
                             use_fast_accum=True)
    h8, h_descale = quantize_rows(swiglu(h))
    out = tp.scaled_grouped_mm(h8, down[0], h_descale, down[1], offsets=offsets, out_dtype=torch.bfloat16,
                               use_fast_accum=True)
    return out.type_as(x)


def fp8_swiglu_experts_emulated(x: torch.Tensor, num_tokens_per_expert: torch.Tensor, gate_up: tuple, down: tuple
                                ) -> torch.Tensor:
    """`fp8_swiglu_experts`' definition: the same e4m3 roundings, fp32 matmuls per expert, bf16 where the fast
    path writes bf16 (the GEMM outputs). Shapes as `fp8_swiglu_experts`."""
    counts = [int(n) for n in num_tokens_per_expert.tolist()]
    outs, start = [], 0

    def gemm(a, weight, e):
        a8, a_descale = quantize_rows(a)
        w8, w_descale = weight
        return ((a8.float() * a_descale[:, None]) @ (w8[e].float() * w_descale[e][None, :])).to(torch.bfloat16)

    for e, n in enumerate(counts):
        rows = x[start:start + n]
        outs.append(gemm(swiglu(gemm(rows, gate_up, e)), down, e))
        start += n
    return torch.cat(outs).type_as(x) if outs else x.new_zeros((0, down[0].shape[-1]))
