"""The one-pass Triton kernel of `reference.quantize_rows_reference`: per row, read ``a`` and ``b`` once (the whole
row in registers), apply the tanh-GELU to b's columns, take the row's amax, and write the e4m3 row and its scale.
3 bytes an element of bf16 input (read 2, write 1) plus 4 a row, where an amax pass and a cast pass read it twice.

Without APPROX (`quantize_rows_triton`'s ``approx``), bit for bit the reference, on the GPU and under Triton's CPU
interpreter alike, because every rounding is spelled out where the interpreter's casts are not exact (it truncates
fp32 -> bf16 and rounds e4m3 half-up without carry):
bf16 rounding is integer round-to-nearest-even on the bits, e4m3 rounding happens in fp32 arithmetic onto e4m3's
grid (the cast after it is exact), the quotient is ``div_rn`` (torch divides exactly; Triton's ``/`` need not).
The GELU's tanh is libdevice's on the GPU (the interpreter runs no libdevice call: there, one built of ``exp``):
torch's CUDA GELU calls CUDA's ``tanhf``, so the GELU matches eager torch where the two tanh agree after rounding to
bf16 (the GPU test counts the bytes where they do not).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from xstage_dit.ops.fp8_rows.reference import E4M3, RECIP_E4M3_MAX, check_parts

__all__ = ["num_warps_for", "quantize_rows_triton"]

# dtype codes of the kernel's rounding of the GELU and of the scale to the input dtype
_F32, _BF16, _F16 = 0, 1, 2
_DTYPE_CODES = {torch.float32: _F32, torch.bfloat16: _BF16, torch.float16: _F16}


@triton.jit
def _round_to(x, DTYPE: tl.constexpr, HW: tl.constexpr):
    """fp32 x rounded to the input dtype (round to nearest even) and back to fp32; HW: by the GPU's conversion (the
    same rounding in one instruction, where the interpreter's conversion truncates)."""
    if DTYPE == 1 and HW:
        x = x.to(tl.bfloat16).to(tl.float32)
    elif DTYPE == 1:  # bf16: integer RNE on the bits (c10::BFloat16's rule; NaN and inf stay what they are)
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    elif DTYPE == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _tanh(y, LIBDEVICE: tl.constexpr, APPROX: tl.constexpr):
    """tanh(y): libdevice's on the GPU, or with APPROX the GPU's one-instruction ``tanh.approx.f32`` (relative error
    below 2**-10.9: the GELU's bf16 value moves by one bf16 step now and then); under the CPU interpreter, which
    runs neither, 1 - 2 / (e**2y + 1) in fp32 (within a few ulp: the GELU's bf16 values agree with torch's but for
    rare ties)."""
    if APPROX and LIBDEVICE:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [y], dtype=tl.float32, is_pure=True,
                                      pack=1)
    elif LIBDEVICE:
        t = libdevice.tanh(y)
    else:
        t = 1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)
    return t


@triton.jit
def _gelu_tanh(x, LIBDEVICE: tl.constexpr, APPROX: tl.constexpr):
    """torch's tanh-GELU in fp32, its operations in its order: 0.5 * x * (1 + tanh(beta * (x + kappa * x**3))),
    beta = sqrt(2) * 2/sqrt(pi) * 0.5 and kappa = 0.044715 rounded to fp32 as torch's kernels round them. On the
    GPU ``x + kappa * x**3`` contracts to one fma, as nvcc contracts torch's CUDA GELU."""
    x_cube = x * x * x
    inner = 0.7978845608028654 * (x + 0.044715 * x_cube)
    return 0.5 * x * (1.0 + _tanh(inner, LIBDEVICE, APPROX))


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)  # torch's amax propagates NaN


@triton.jit
def _to_e4m3_grid(v):
    """v (fp32, |v| <= 448 or NaN) rounded to nearest even onto e4m3's grid, still fp32 (then any cast is exact).
    With |v| in [2**k, 2**(k+1)) and e4m3's step u = 2**(k-3) (2**-9 below 2**-6, the subnormals), |v| + 2**23 * u
    lies where fp32's own step is u: the addition rounds |v| to a multiple of u, the subtraction is exact."""
    bits = v.to(tl.uint32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    exponent = tl.minimum(tl.maximum(exponent, 127 - 6), 127 + 8)  # subnormal step below; NaN's stays finite
    magic = ((exponent + 20) << 23).to(tl.float32, bitcast=True)
    mag = ((bits & 0x7FFFFFFF).to(tl.float32, bitcast=True) + magic) - magic
    return (mag.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_rows_kernel(A, B, Q, S, stride_a, stride_b, width_a, width, recip_max, amax_floor, GELU_B: tl.constexpr,
                     DTYPE: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, APPROX: tl.constexpr):
    """Program m: row m of cat([a, gelu(b)]) -> q[m, :width] (e4m3 bytes, Q a uint8 view) and s[m] (fp32).
    APPROX (on the GPU): the GELU's tanh is ``tanh.approx.f32`` and the quotient a product with the row's reciprocal
    scale, cast by the GPU's own round-to-nearest-even e4m3 conversion: 3x faster at FLUX's widest rows, where the
    exact tanh and division make the kernel compute-bound (fp8/NOTES.md)."""
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    in_a = col < width_a
    in_b = (col >= width_a) & (col < width)
    xa = tl.load(A + row * stride_a + col, mask=in_a, other=0.0).to(tl.float32)
    xb = tl.load(B + row * stride_b + (col - width_a), mask=in_b, other=0.0).to(tl.float32)
    if GELU_B:
        # diffusers' GELU leaves it in the input dtype: rounded there
        xb = _round_to(_gelu_tanh(xb, LIBDEVICE, APPROX), DTYPE, LIBDEVICE)
    x = tl.where(in_a, xa, xb)
    amax = _max_nan(tl.reduce(tl.abs(x), 0, _max_nan), amax_floor)  # the floor: torchao's activation_value_lb
    scale = _round_to(amax * recip_max, DTYPE, LIBDEVICE)  # torchao divides amax by 448 in the input dtype (reference)
    if APPROX and LIBDEVICE:
        # x * (1 / scale) for x / scale; a row of zeros: 0 * inf = NaN, which the conversion makes 0x7F as CUDA does
        v = tl.clamp(x * tl.math.div_rn(1.0, scale), -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        q = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        v = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        q = _to_e4m3_grid(v).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        # NaN (a row of zeros: 0 / 0) as c10 casts it, 0x7F with the sign: the interpreter's cast makes no NaN.
        nan_byte = 0x7F | ((v.to(tl.uint32, bitcast=True) >> 24) & 0x80)
        q = tl.where(v != v, nan_byte.to(tl.uint8), q)
    tl.store(Q + row * width + col, q, mask=col < width)
    tl.store(S + row, scale)


@functools.lru_cache(maxsize=64)  # per call otherwise: a CPU tensor built and converted on the launch's host path
def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """value rounded to dtype, as torch's clamp of a tensor of that dtype rounds its bound."""
    return float(torch.tensor(value, dtype=torch.float32).to(dtype).float())


def num_warps_for(block: int) -> int:
    """Warps of a program holding ``block`` columns: 16 fp32 values a thread, 4 to 32 warps (the fastest of 8, 16
    and 32 at FLUX's rows on an H100: 32 at 16,384 columns, 8 at 4,096; fp8/NOTES.md)."""
    return max(4, min(32, block // 512))


def quantize_rows_triton(a: torch.Tensor | None, b: torch.Tensor | None, gelu_b: bool = False, *,
                         approx: bool = False, amax_floor: float = 0.0, num_warps: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.quantize_rows_reference` in one Triton launch (one program a row). a: (M, Ka), b: (M, Kb), either
    None or empty, Ka + Kb <= `reference.MAX_ROW_WIDTH` -> (q (M, Ka + Kb) e4m3 contiguous, scale (M, 1) fp32).
    amax_floor: the reference's (torchao's activation_value_lb; 0: none).
    approx: the GPU's approximate tanh and a reciprocal product (the kernel's APPROX; no effect under the
    interpreter, which runs the exact arithmetic). num_warps: the launch's warps (default `num_warps_for` the row's
    power-of-two block)."""
    parts = check_parts(a, b)
    q = torch.empty((parts.rows, parts.width), dtype=E4M3, device=parts.device)
    scale = torch.empty((parts.rows, 1), dtype=torch.float32, device=parts.device)
    if parts.rows == 0:
        return q, scale
    # An absent or empty part is never read (its columns are masked off): the other part stands in as its pointer.
    a_ptr = a if a is not None and parts.width_a else b
    b_ptr = b if b is not None and parts.width_b else a
    block = triton.next_power_of_2(parts.width)
    _fp8_rows_kernel[(parts.rows,)](
        a_ptr, b_ptr, q.view(torch.uint8), scale, a_ptr.stride(0), b_ptr.stride(0), parts.width_a, parts.width,
        RECIP_E4M3_MAX, _in_dtype(amax_floor, parts.dtype), GELU_B=bool(gelu_b and parts.width_b),
        DTYPE=_DTYPE_CODES[parts.dtype], BLOCK=block,
        LIBDEVICE=not triton.knobs.runtime.interpret, APPROX=bool(approx), num_warps=num_warps or num_warps_for(block))
    return q, scale
