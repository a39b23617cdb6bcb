"""Row-wise dynamic FP8 (e4m3) quantization of ``cat([a, gelu_tanh(b)], -1)`` in one pass: what torchao's
``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` does to a linear layer's activation, fused with
the concatenation and GELU that produce it in FLUX (the single block's ``proj_out`` input, the double block's FF).

- `quantize_rows(a, b, gelu_b)`: the public op, registered as ``torch.ops.xstage_dit.fp8_rows`` (traceable by
  ``torch.compile``); the Triton kernel (`kernel.quantize_rows_triton`) on CUDA, the reference elsewhere.
- `reference.quantize_rows_reference`: the definition (torchao's formula, quoted there), bit for bit the kernel's.

Row-wise FP8 (`features.fp8_fused`) quantizes those two activations with it, ``approx=True``: ~3x Inductor's two
kernels there on an H100 (benchmarks/bench_row_quant.py, fp8/NOTES.md).
"""

from __future__ import annotations

import torch

from xstage_dit.ops.fp8_rows.kernel import quantize_rows_triton
from xstage_dit.ops.fp8_rows.reference import E4M3, MAX_ROW_WIDTH, check_parts, quantize_rows_reference
from xstage_dit.ops.registry import NAMESPACE

__all__ = ["MAX_ROW_WIDTH", "quantize_rows", "quantize_rows_reference", "quantize_rows_triton"]


@torch.library.custom_op(f"{NAMESPACE}::fp8_rows", mutates_args=())
def _fp8_rows(a: torch.Tensor | None, b: torch.Tensor | None, gelu_b: bool, approx: bool, amax_floor: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    first = a if a is not None else b
    if first is not None and first.is_cuda:
        return quantize_rows_triton(a, b, gelu_b, approx=approx, amax_floor=amax_floor)  # it checks the parts
    check_parts(a, b)  # the kernel's limits on every device: the op means one thing wherever it runs
    return quantize_rows_reference(a, b, gelu_b, amax_floor)


@_fp8_rows.register_fake
def _fp8_rows_fake(a: torch.Tensor | None, b: torch.Tensor | None, gelu_b: bool, approx: bool, amax_floor: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    parts = check_parts(a, b)
    return (torch.empty((parts.rows, parts.width), dtype=E4M3, device=parts.device),
            torch.empty((parts.rows, 1), dtype=torch.float32, device=parts.device))


def quantize_rows(a: torch.Tensor | None, b: torch.Tensor | None, gelu_b: bool = False, approx: bool = False,
                  amax_floor: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """a: (M, Ka), b: (M, Kb) of one dtype (bf16 / fp16 / fp32; either None or empty, Ka + Kb <= `MAX_ROW_WIDTH`)
    -> (q (M, Ka + Kb) float8_e4m3fn contiguous, scale (M, 1) float32), torchao's row-wise quantization of
    ``cat([a, gelu_tanh(b) if gelu_b else b], -1)``: ``scale = bf16(amax / 448)``, ``q = e4m3(clamp(x / scale))``.

    Example (FLUX's single block, M = 4608 tokens): ``q, scale = quantize_rows(attn_out, mlp_hidden, gelu_b=True)``
    with attn_out (4608, 3072) and mlp_hidden (4608, 12288) bf16 gives q (4608, 15360), scale (4608, 1).

    approx: on a GPU, the tanh of the GELU by the hardware's approximate instruction and the quotient as a product
    with the reciprocal scale (`kernel.quantize_rows_triton`): ~3x faster at FLUX's widest rows, and off torchao's
    bytes by one e4m3 step in 0.02-0.16 % of them (fp8/NOTES.md); elsewhere the reference, exactly. amax_floor:
    torchao's ``activation_value_lb`` (0: none, and a row of zeros quantizes to NaN, as torchao's does).
    """
    return torch.ops.xstage_dit.fp8_rows(a, b, gelu_b, approx, amax_floor)
