"""The one tolerance table of the test suite, and the error measures the tests compare against it.

Every comparison of a fast path with its reference names a row here, so a tolerance is set (and
argued) once: what differs between the two computations, and how much that can move the result.

    from tests.helpers.tolerances import TOL, rel_err
    assert rel_err(out, ref) < TOL.bf16_kernel
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerances:
    # Relative L2 error (``rel_err``) of a bf16 / fp16 fast path against the fp32 reference rounded once:
    # one bf16 rounding of the output is ~4e-3; accumulation order and the rounding of P (attention) or h
    # (the MoE's Linear-1 output) add a few of those.
    bf16_kernel: float = 2e-2
    # The fused MoE expert MLP (bf16) against grouped matmul: the same roundings in the same places.
    bf16_moe: float = 1e-2
    # fp32 on the CPU (references, gloo ranks): only summation order differs.
    fp32: float = 1e-5
    # Max abs error of a whole parallel pipeline against the single process in fp32 (the denoising loop
    # compounds reassociation over steps).
    fp32_pipeline: float = 1e-4
    # 8-bit images of outputs that agree within fp32 reassociation differ by at most one level.
    image_levels: int = 1
    # Relative L2 of an 8-bit attention kernel against the fp32 reference, N(0, 1) inputs. cuDNN's FP8 recipe
    # rounds q, k, v, P and O to e4m3 (3 mantissa bits: each rounding ~2.5 % RMS); its fp32 emulation
    # (ops/attention/fp8_reference.py) measured ~0.06 on the CPU. SageAttention's int8 Q K^T (per-block scales)
    # and fp16 P V: ~0.013 emulated.
    cudnn_fp8_attention: float = 8e-2
    sage_attention: float = 2e-2
    # FP8 SwiGLU experts (ops/moe/fp8_experts.py) against the bf16 experts: e4m3 roundings of x, both weights and
    # the SwiGLU output around two GEMMs; the emulation measured ~0.066 on N(0, 1) tokens (CPU).
    fp8_experts: float = 1e-1
    # A kernel against its own emulation: its error may exceed the emulated one by this factor plus bf16_kernel
    # (the kernel rounds P against a running row maximum, the emulation against the final one).
    fp8_over_emulation: float = 1.25


TOL = Tolerances()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ``|out - ref| / |ref|`` in fp32 (0 for two empty tensors)."""
    if out.numel() == 0 and ref.numel() == 0:
        return 0.0
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))
