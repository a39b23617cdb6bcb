"""The 8-bit attention kernels as window kernels (``kernels.py``'s interface), candidates of the kernel sweep only
where FP8 attention was asked for (``features.fp8``: ``Fp8Config.attention``):

    supports(geom, dtype, device, has_window) -> None, or the reason it refuses the problem
    run(q, k, v, target, geom, scale)        -> None (writes the bf16 output through ``target.view``)

``cudnn-fp8``: cuDNN's FP8 SDPA forward (`cudnn_fp8`): q, k, v quantized to e4m3 on the device with one scale per
tensor (`fp8_quant.quantize_qkv`), O in e4m3 (all Hopper's cuDNN writes from FP8 inputs), dequantized by the store.
``sage``: SageAttention 1 (`sage`): int8 Q K^T with per-block scales, fp16 P V, bf16 O; refused unless the key
count is a multiple of its key block (`sage.KEY_BLOCK`: it leaves the padding keys unmasked).

Neither writes a strided bf16 output itself, so each runs on this rank's heads over the whole sequence into a local
buffer and a store kernel (`fp8_quant.store_rows`) writes every row, dequantized, into its owner's slot of the peer
window: the post-attention All-to-All as remote stores, unfused (one extra pass over the output). At world size 1
the "window" is the output itself (``window_path.plain_kernel_attention``). Padding rows (S not divisible by P) are
computed for nothing and never stored; keys past S are never read.

The error of each against the fp32 reference: ``fp8_reference`` (the emulations), measured on the served shapes by
``benchmarks/bench_fp8_error.py --attention``.
"""

from __future__ import annotations

import torch

from xstage_dit.ops.attention.window import WindowGeometry

__all__ = ["CudnnFp8Kernel", "FP8_KERNEL_CLASSES", "SageKernel"]

DTYPES = (torch.float16, torch.bfloat16)


class _StoredOutputKernel:
    """An attention kernel that writes a local output, stored into the window by `fp8_quant.store_rows`."""

    name = ""

    def _unavailable(self, device: torch.device, geom: WindowGeometry) -> str | None:
        raise NotImplementedError

    def _attend(self, q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q (B, P*L, Hr, D), k, v (B, S, Hr, D) -> (output (B, P*L, Hr, D), its descale or None)."""
        raise NotImplementedError

    def supports(self, geom: WindowGeometry, dtype: torch.dtype, device: torch.device, has_window: bool
                 ) -> str | None:
        if not has_window:
            return f"{self.name} stores its output through a strided view: it needs the peer window (not a pointer table)"
        if dtype not in DTYPES:
            return f"{self.name} takes float16/bfloat16 inputs, got {dtype}"
        return self._unavailable(torch.device(device), geom)

    def run(self, q, k, v, target, geom: WindowGeometry, scale: float) -> None:
        """q, k, v: (B, rows_in >= P*L, Hr, D), rows [0, S) the whole sequence in token order; target: the
        ``kernels.OutTarget`` whose ``view`` is the window view (B*P, L, Hr, D) at the rank's head offset."""
        from xstage_dit.ops.attention.fp8_quant import store_rows

        rows = geom.world_size * geom.rows_per_owner
        if q.shape[1] < rows or k.shape[1] < geom.seq_len:
            raise ValueError(f"expected q with >= P*L = {rows} rows and k, v with >= S = {geom.seq_len}, got "
                             f"{q.shape[1]} and {k.shape[1]}")
        if target.view is None:
            raise ValueError(f"kernel {self.name} writes through the peer window's view, got none")
        out, descale = self._attend(q[:, :rows], k[:, :geom.seq_len], v[:, :geom.seq_len], scale)
        store_rows(out, target.view, world_size=geom.world_size, seq_len=geom.seq_len, descale=descale)


class CudnnFp8Kernel(_StoredOutputKernel):
    """cuDNN's FP8 forward on e4m3 q, k, v with per-tensor scales; O in e4m3, dequantized by the store."""

    name = "cudnn-fp8"

    def _unavailable(self, device, geom):
        from xstage_dit.ops.attention.cudnn_fp8 import unavailable

        return unavailable(device, geom.head_dim)

    def _attend(self, q, k, v, scale):
        from xstage_dit.ops.attention.cudnn_fp8 import shared_attention
        from xstage_dit.ops.attention.fp8_quant import DESCALE_O, quantize_qkv

        x = quantize_qkv(q, k, v)
        return shared_attention().run(x, scale), x.slot(DESCALE_O)


class SageKernel(_StoredOutputKernel):
    """SageAttention 1: int8 Q K^T (per-block scales), fp16 P V, output in the input dtype."""

    name = "sage"

    def _unavailable(self, device, geom):
        from xstage_dit.ops.attention.sage import unavailable

        return unavailable(device, geom.head_dim, geom.seq_len)

    def _attend(self, q, k, v, scale):
        from xstage_dit.ops.attention.sage import sage_attention

        return sage_attention(q, k, v, scale), None


FP8_KERNEL_CLASSES = {"cudnn-fp8": CudnnFp8Kernel, "sage": SageKernel}
