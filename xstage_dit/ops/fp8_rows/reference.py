"""The definition of the row-wise FP8 quantization of ``cat([a, gelu_tanh(b)], -1)``, in torch: what torchao 0.18.0's
row-wise dynamic activation quantization (``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``)
computes for that tensor, and the input checks the op and its kernel share.

torchao's formula (``Float8Tensor.from_hp`` in torchao/quantization/quantize_/workflows/float8/float8_tensor.py, its
"torch" kernel choice, with the config's defaults ``activation_value_lb = activation_value_ub = None``; it calls
``_choose_scale_float8`` and ``_quantize_affine_float8`` of torchao/quantization/quant_primitives.py)::

    amax  = |x|.amax(dim=-1, keepdim=True)                    # in x's dtype (exact), no lower bound: no eps
    scale = (amax / 448).to(float32)                          # divided IN x's dtype: rounded to bf16 / fp16
    q     = (x.float() / scale).clamp(-448, 448).to(e4m3fn)   # true division, saturate, round to nearest even

``amax / 448`` divides a tensor by a Python scalar: torch's CUDA kernel multiplies by the fp32 reciprocal, its CPU
kernel divides. The definition here is the CUDA one (``amax * fp32(1/448)``, rounded to x's dtype). Rounded to bf16
the two agree for every amax (tests/ops/test_fp8_rows_cpu.py checks all of them); rounded to fp16 for every amax
>= 448 * 2**-14 (a normal fp16 scale) and all but a few dozen below; for fp32 inputs the scales of CPU and CUDA
torchao can differ by one ulp.

A row of zeros has scale 0 and quantizes to NaN (0 / 0), as torchao's does: the NaN's sign is the device's (x86
makes 0 / 0 negative, 0xFF; CUDA positive, 0x7F).

GELU: diffusers' FLUX blocks apply ``nn.GELU(approximate="tanh")`` to a bf16 tensor, so the activation torchao sees
is the GELU rounded to the input dtype; the reference rounds there too (``F.gelu`` in b's dtype). Inductor, fusing
the GELU into its quantization kernels, keeps it in fp32 (no rounding; ``emulate_precision_casts`` off): a different,
also valid, reference whose bytes differ where the rounding moves an e4m3 value.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["DTYPES", "E4M3", "E4M3_MAX", "MAX_ROW_WIDTH", "RECIP_E4M3_MAX", "RowParts", "check_parts",
           "quantize_rows_reference"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# fp32(1 / 448): what torch's CUDA division by the Python scalar 448 multiplies by (module docstring).
RECIP_E4M3_MAX = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(E4M3_MAX, dtype=torch.float32))
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The widest row the Triton kernel holds in registers (one program per row, the whole row at once).
MAX_ROW_WIDTH = 16384


class RowParts:
    """What `check_parts` learned of (a, b): rows, the widths of the two parts, their dtype and device."""

    __slots__ = ("rows", "width_a", "width_b", "dtype", "device")

    def __init__(self, rows: int, width_a: int, width_b: int, dtype: torch.dtype, device: torch.device):
        self.rows, self.width_a, self.width_b, self.dtype, self.device = rows, width_a, width_b, dtype, device

    @property
    def width(self) -> int:
        return self.width_a + self.width_b


def check_parts(a: torch.Tensor | None, b: torch.Tensor | None, *, max_width: int | None = MAX_ROW_WIDTH) -> RowParts:
    """a: (M, Ka) or None, b: (M, Kb) or None -> `RowParts`; ValueError naming what is wrong: a part not 2-D, of a
    dtype outside bf16 / fp16 / fp32, parts of different dtypes, rows or devices, a part with a strided last dim, both
    parts absent or empty, or a row wider than ``max_width`` (None: no limit)."""
    given = {name: t for name, t in (("a", a), ("b", b)) if t is not None}
    if not given:
        raise ValueError("expected a or b to be a tensor, got None for both")
    for name, t in given.items():
        if t.dim() != 2:
            raise ValueError(f"expected {name} to be 2-D (rows, columns), got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise ValueError(f"expected {name} of dtype bfloat16, float16 or float32, got {t.dtype}")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"expected {name} with a contiguous last dim, got strides {t.stride()}")
    if a is not None and b is not None:
        if a.shape[0] != b.shape[0]:
            raise ValueError(f"expected a and b with the same rows, got a {tuple(a.shape)} and b {tuple(b.shape)}")
        if a.dtype != b.dtype:
            raise ValueError(f"expected a and b of one dtype, got a {a.dtype} and b {b.dtype}")
        if a.device != b.device:
            raise ValueError(f"expected a and b on one device, got a on {a.device} and b on {b.device}")
    first = next(iter(given.values()))
    parts = RowParts(first.shape[0], 0 if a is None else a.shape[1], 0 if b is None else b.shape[1], first.dtype,
                     first.device)
    if parts.width == 0:
        raise ValueError(f"expected a row of at least one column, got a {None if a is None else tuple(a.shape)} and "
                         f"b {None if b is None else tuple(b.shape)}")
    if max_width is not None and parts.width > max_width:
        raise ValueError(f"expected Ka + Kb <= {max_width} (the widest row the kernel holds in registers), got "
                         f"{parts.width_a} + {parts.width_b} = {parts.width}")
    return parts


def quantize_rows_reference(a: torch.Tensor | None, b: torch.Tensor | None, gelu_b: bool = False,
                            amax_floor: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """a: (M, Ka), b: (M, Kb) (either None or empty; one dtype) -> (q (M, Ka + Kb) float8_e4m3fn contiguous,
    scale (M, 1) float32): torchao's row-wise quantization of ``x = cat([a, gelu_tanh(b) if gelu_b else b], -1)``
    (module docstring), ``x ~= q.float() * scale``. amax_floor: torchao's ``activation_value_lb``, the least amax a
    scale is computed from (0: none; a row of zeros then quantizes to NaN); exact in the input dtype, or rounded
    there as torchao's clamp rounds it.

    Example: ``q, scale = quantize_rows_reference(attn_out, mlp_hidden, gelu_b=True)`` is what torchao makes of
    the input of FLUX's single-block ``proj_out``.
    """
    dtype = check_parts(a, b, max_width=None).dtype
    # F.gelu in b's own dtype: the GELU rounded to it, as diffusers' nn.GELU(approximate="tanh") leaves it.
    tail = F.gelu(b, approximate="tanh") if (gelu_b and b is not None) else b
    x = torch.cat([t for t in (a, tail) if t is not None], dim=-1)
    amax = x.abs().amax(dim=-1, keepdim=True)
    if amax_floor:
        amax = torch.clamp(amax, min=amax_floor)
    scale = (amax.float() * RECIP_E4M3_MAX).to(dtype).float()
    q = (x.float() / scale).clamp(min=-E4M3_MAX, max=E4M3_MAX).to(E4M3)
    return q.contiguous(), scale
