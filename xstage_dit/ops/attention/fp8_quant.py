"""The Triton kernels around the FP8 attention kernels: q, k, v to e4m3 with per-tensor scales computed on the
device (`quantize_qkv`), and the attention output written, dequantized, where it belongs (`store_rows`).

Device code knows pointers, strides and sizes; the launchers check tensors. The torch definitions are
`fp8_reference.quantize_reference` (bit for bit what `quantize_qkv` writes on the GPU; Triton's CPU interpreter
rounds float8 wrongly, so only the GPU tests compare the two) and plain indexing for `store_rows` (checked in
the interpreter with a bf16 source).

Quantizing costs two passes over q, k, v (the amax, then scale and cast: 5 bytes an element of bf16 input), one
launch per pass and tensor whatever the layout; no host synchronization: the scales stay on the device and reach
the attention kernel as pointers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from xstage_dit.ops.attention.fp8_reference import E4M3

__all__ = ["Fp8QKV", "check_qkv_shapes", "quantize_qkv", "store_rows"]

# Slots of the scales buffer (one fp32 per 16-byte row: every slot an aligned scalar tensor for cuDNN).
AMAX_Q, AMAX_K, AMAX_V, DESCALE_Q, DESCALE_K, DESCALE_V, SCALE_O, DESCALE_O = range(8)
_SCALE_O, _DESCALE_O = tl.constexpr(SCALE_O), tl.constexpr(DESCALE_O)  # the kernels' view of the two O slots
_BLOCK_ROWS = 64


@triton.jit
def _amax_kernel(X, scales, slot, s_b, s_s, s_h, heads, rows, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row block, batch*head): max |x| of its rows into scales[slot] (atomic; the buffer is zeroed first).
    One launch per tensor: no run-time branch picks a tensor (Triton would have to merge a pointer per branch)."""
    pid_s, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // heads, pid_bh % heads
    r = pid_s * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, HEAD_DIM)
    ptrs = X + b.to(tl.int64) * s_b + h.to(tl.int64) * s_h + r[:, None].to(tl.int64) * s_s + d[None, :]
    x = tl.load(ptrs, mask=(r < rows)[:, None], other=0.0).to(tl.float32)
    tl.atomic_max(scales + slot * 4, tl.max(tl.max(tl.abs(x), 1), 0))


@triton.jit
def _pow2(power):
    """2.0 ** power (int32, within fp32's normal exponents) built from its bits: exact, no approximate exp2."""
    return ((power + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scale_power(amax):
    """floor(log2(448 / amax)) exactly, from amax's exponent and mantissa bits (amax = m * 2**E, m in [1, 2);
    448 = 1.75 * 2**8): 8 - E, one less where m > 1.75 (fp8_reference.po2_scale's rule)."""
    bits = tl.maximum(amax, 8.673617379884035e-19).to(tl.int32, bitcast=True)  # 2**-60, as fp8_reference clamps
    exponent = ((bits >> 23) & 0xFF) - 127
    return 8 - exponent - ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)


@triton.jit
def _quant_kernel(X, Xo, scales, slot, s_b, s_s, s_h, heads, rows, IS_V: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Program (row block, batch*head): x * scale -> e4m3 into the contiguous (B, rows, H, D) output; scale =
    2**floor(log2(448 / amax)) of scales[slot] (fp8_reference.po2_scale, exactly: `_scale_power`). The first program
    writes the descale at slot + 3 and, for V, O's scale and descale (half V's scale: fp8_reference's rule)."""
    pid_s, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // heads, pid_bh % heads
    power = _scale_power(tl.load(scales + slot * 4))
    scale = _pow2(power)
    if (pid_s == 0) & (pid_bh == 0):
        tl.store(scales + (slot + 3) * 4, _pow2(-power))
        if IS_V:
            tl.store(scales + _SCALE_O * 4, _pow2(power - 1))
            tl.store(scales + _DESCALE_O * 4, _pow2(1 - power))
    r = pid_s * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, HEAD_DIM)
    ok = (r < rows)[:, None]
    x = tl.load(X + b.to(tl.int64) * s_b + h.to(tl.int64) * s_h + r[:, None].to(tl.int64) * s_s + d[None, :],
                mask=ok, other=0.0).to(tl.float32)
    out_row = (b.to(tl.int64) * rows + r[:, None].to(tl.int64)) * heads + h
    tl.store(Xo + out_row * HEAD_DIM + d[None, :], (x * scale).to(Xo.dtype.element_ty), mask=ok)


@triton.jit
def _store_rows_kernel(src, dst, descale, ss_b, ss_s, ss_h, sd_slot, sd_row, sd_h, heads, world, rows_per_owner,
                       seq_len, HAS_DESCALE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row block, slot*heads + head): rows [r0, r0 + BLOCK) of window slot ``slot = b*P + o`` (owner o's
    buffer for batch b) <- rows o*L + r of batch b of ``src`` (times the descale), masked to the owner's valid rows
    (padding rows of a peer's buffer are never written)."""
    pid_s, pid_sh = tl.program_id(0), tl.program_id(1)
    slot, h = pid_sh // heads, pid_sh % heads
    b, o = slot // world, slot % world
    valid = tl.minimum(rows_per_owner, seq_len - o * rows_per_owner)
    r = pid_s * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, HEAD_DIM)
    ok = (r < valid)[:, None]
    src_row = o * rows_per_owner + r
    # No ``other``: the masked-out values are never stored (and a float constant need not convert to e4m3).
    x = tl.load(src + b.to(tl.int64) * ss_b + src_row[:, None].to(tl.int64) * ss_s + h.to(tl.int64) * ss_h
                + d[None, :], mask=ok).to(tl.float32)
    if HAS_DESCALE:
        x = x * tl.load(descale)
    tl.store(dst + slot.to(tl.int64) * sd_slot + r[:, None].to(tl.int64) * sd_row + h.to(tl.int64) * sd_h
             + d[None, :], x.to(dst.dtype.element_ty), mask=ok)


@dataclass
class Fp8QKV:
    """q, k, v in e4m3, contiguous (B, rows, H, D), and the device buffer of their scales (fp32 (8, 4): slot i at
    [i, 0]; `descale(i)` is a one-element view of it)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scales: torch.Tensor

    def slot(self, index: int) -> torch.Tensor:
        return self.scales[index, :1]


def check_qkv_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q (B, Sq, H, D), k, v (B, Skv, H, D), all of one dtype, bfloat16 or float16; ValueError naming what is not."""
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"expected q (B, Sq, H, D) and k, v (B, Skv, H, D), got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"expected q, k, v of one dtype, bfloat16 or float16, got {q.dtype}, {k.dtype}, {v.dtype}")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if not (q.is_cuda and k.device == q.device and v.device == q.device):
        raise ValueError(f"expected q, k, v on one CUDA device, got {q.device}, {k.device}, {v.device}")
    check_qkv_shapes(q, k, v)
    head_dim = q.shape[-1]
    if head_dim < 16 or head_dim & (head_dim - 1) or any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError(f"expected a power-of-two head_dim >= 16 with a contiguous last dim, got {head_dim} and "
                         f"strides {q.stride()}, {k.stride()}, {v.stride()}")


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Fp8QKV:
    """q: (B, Sq, H, D), k, v: (B, Skv, H, D) (bf16/fp16, any strides with a contiguous last dim) -> `Fp8QKV`,
    each tensor with its own per-tensor scale (``fp8_reference.quantize_reference``'s values, bit for bit)."""
    _check_qkv(q, k, v)
    batch, rows_q, heads, head_dim = q.shape
    rows_kv = k.shape[1]
    outs = [torch.empty((batch, n, heads, head_dim), dtype=E4M3, device=q.device) for n in (rows_q, rows_kv, rows_kv)]
    scales = torch.zeros((8, 4), dtype=torch.float32, device=q.device)
    for slot, (src, out) in enumerate(zip((q, k, v), outs)):  # slots AMAX_Q, AMAX_K, AMAX_V
        grid = (max(1, triton.cdiv(src.shape[1], _BLOCK_ROWS)), batch * heads)
        _amax_kernel[grid](src, scales, slot, *src.stride()[:3], heads, src.shape[1], HEAD_DIM=head_dim,
                           BLOCK=_BLOCK_ROWS)
    for slot, (src, out) in enumerate(zip((q, k, v), outs)):
        grid = (max(1, triton.cdiv(src.shape[1], _BLOCK_ROWS)), batch * heads)
        _quant_kernel[grid](src, out, scales, slot, *src.stride()[:3], heads, src.shape[1], IS_V=slot == AMAX_V,
                            HEAD_DIM=head_dim, BLOCK=_BLOCK_ROWS)
    return Fp8QKV(outs[0], outs[1], outs[2], scales)


def store_rows(src: torch.Tensor, dst: torch.Tensor, *, world_size: int, seq_len: int,
               descale: torch.Tensor | None = None) -> None:
    """The attention output written where it belongs: ``dst[b*P + o, r] = src[b, o*L + r] * descale`` for owner o's
    valid rows r < min(L, S - o*L), L = ceil(S / P); nothing else of ``dst`` is touched.

    src: (B, >= P*L rows, H, D) (e4m3 or bf16/fp16, contiguous last dim); dst: (B*P, L, H, D) of the output dtype
    with any strides and a contiguous last dim (the peer window's view at the rank's head offset, or at P = 1 a
    plain (B, S, H, D) output); descale: fp32 one-element tensor on the device, or None (a plain copy).
    """
    batch, rows, heads, head_dim = src.shape
    length = -(-seq_len // world_size)
    if dst.dim() != 4 or tuple(dst.shape) != (batch * world_size, length, heads, head_dim) or rows < world_size * length:
        raise ValueError(f"expected dst (B*P, L, H, D) = {(batch * world_size, length, heads, head_dim)} and src with "
                         f">= P*L = {world_size * length} rows, got dst {tuple(dst.shape)}, src {tuple(src.shape)}")
    if src.stride(-1) != 1 or dst.stride(-1) != 1 or src.device != dst.device:
        raise ValueError(f"expected src and dst on one device with contiguous last dims, got strides {src.stride()}, "
                         f"{dst.stride()} on {src.device}, {dst.device}")
    grid = (triton.cdiv(length, _BLOCK_ROWS), batch * world_size * heads)
    _store_rows_kernel[grid](src, dst, src if descale is None else descale, *src.stride()[:3], *dst.stride()[:3],
                             heads, world_size, length, seq_len, HAS_DESCALE=descale is not None, HEAD_DIM=head_dim,
                             BLOCK=_BLOCK_ROWS)
