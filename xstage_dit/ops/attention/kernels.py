"""Attention kernels that write the post-attention All-to-All, behind one interface.

Every kernel takes one rank's gathered heads and stores each output row at its owner's place:

    supports(geom, dtype, device, has_window) -> None, or the reason it refuses the problem
    run(q, k, v, target, geom, scale)        -> None (writes through ``target``)

q, k, v: (B, rows_in >= P*L, Hr, D), rows [0, S) the whole sequence in token order (window.py).
target: an ``OutTarget``: the window view (B*P, L, Hr, D) at the rank's head offset when a peer window
exists, and always the pointer table (owner addresses and element strides) for the Triton kernel.

Kernels: ``fa4`` (FlashAttention-4, CuTe DSL), ``fa4-m64`` (FA4 on 64-row tiles, for slots that end in a
half tile), ``fa4-split`` (FA4's 128-row tiles, then the slots' half-tile tails on 64-row tiles), ``fa4-gqa``
(the owner blocks as GQA query heads of one KV head: FA4 packs them into full tiles), ``fa4-gqa-unpacked``
(the same launch unpacked, for slots of whole tiles),
``cudnn`` (cuDNN through cudnn-frontend's graph with an explicit O stride), ``triton`` (our kernel through
its pointer table: takes what the others refuse, runs in the CPU interpreter, and is the reference fast
path); and, only where FP8 attention was asked for, the 8-bit kernels of ``fp8_kernels`` (``cudnn-fp8``,
``sage``: a local output stored into the window by a store kernel). Which one runs for a shape is chosen by ``xstage_dit.schedule.attention_kernel`` from a measured
sweep and handed to the op; nothing here measures or loads a cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from xstage_dit.ops.attention.fp8_kernels import FP8_KERNEL_CLASSES
from xstage_dit.ops.attention.window import WindowGeometry
from xstage_dit.schedule.attention_kernel import DEFAULT_ORDER, FP8_KERNELS

TRITON_DTYPES = (torch.float16, torch.bfloat16)
TRITON_HEAD_DIMS = (16, 32, 64, 128)


@dataclass
class OutTarget:
    """Where one rank's output goes.

    view: (B*P, L, Hr, D) strided tensor over the peer window at the rank's head offset, or None (no window).
    table: int64[P] owner addresses for the pointer-table kernel; table_strides: its (batch, row, head)
        element strides; head_offset: h0, the rank's first head in the owners' (L, H, D) buffers.
    """

    view: torch.Tensor | None
    table: torch.Tensor
    table_strides: tuple[int, int, int]
    head_offset: int


class TritonTableKernel:
    """Our Triton FlashAttention whose epilogue stores through the owner table (``kernel.py``)."""

    name = "triton"

    def __init__(self, config=None):
        self.config = config

    def supports(self, geom: WindowGeometry, dtype: torch.dtype, device: torch.device, has_window: bool) -> str | None:
        if dtype not in TRITON_DTYPES:
            return f"the Triton kernel takes float16/bfloat16, got {dtype}"
        if geom.head_dim not in TRITON_HEAD_DIMS:
            return f"the Triton kernel takes head_dim in {TRITON_HEAD_DIMS}, got {geom.head_dim}"
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            return f"the Triton kernel needs a CUDA device (or TRITON_INTERPRET=1), got {device}"
        return None

    def run(self, q, k, v, target: OutTarget, geom: WindowGeometry, scale: float) -> None:
        from xstage_dit.ops.attention import kernel as kern

        config = self.config or kern.default_config(geom.head_dim, q.device)
        kern.launch_attention(q, k, v, target.table, seq_len=geom.seq_len, seq_local=geom.rows_per_owner,
                              head_offset=target.head_offset, out_strides=target.table_strides, scale=scale,
                              config=config)


class FA4Kernel:
    """FlashAttention-4 writing the window view (``fa4.py``), with FA4's own tile heuristic."""

    name = "fa4"
    tile_mn: tuple[int, int] | None = None

    def __init__(self, kv_mode: str = "auto"):
        from xstage_dit.ops.attention.fa4 import FA4WindowKernel

        self._impl = FA4WindowKernel(self.tile_mn)
        self.kv_mode = kv_mode

    def supports(self, geom, dtype, device, has_window) -> str | None:
        return self._impl.supports(geom, dtype, device, has_window)

    def run(self, q, k, v, target: OutTarget, geom: WindowGeometry, scale: float) -> None:
        self._impl.run(q, k, v, target.view, geom, scale, kv_mode=self.kv_mode)


class FA4HalfTileKernel(FA4Kernel):
    """FA4 on 64-row tiles, for window slots whose L ends in at most half a 128-row tile.

    With 128-row tiles each slot of L = 128 k + r rows (0 < r <= 64) runs a last tile at most half full: at FLUX
    1024², P = 8 (L = 576) all heads in one launch make 24 x 8 x 5 = 960 tiles for the work of 864, one more wave of
    132 SMs. 64-row tiles launch no empty rows there, but one MMA warpgroup per CTA runs each tile at well under
    half the rate: measured slower than FA4's own tiles on those rows (benchmarks/results/attention/NOTES.md, "The
    whole graph-timed window table, and FA4 on 64-row tiles"). Kept as an explicit choice (``fused:fa4-m64``) and a
    benchmark column, out of the default sweep. Elsewhere it has nothing to save, and refuses.
    """

    name = "fa4-m64"
    tile_mn = (64, 128)

    def supports(self, geom, dtype, device, has_window) -> str | None:
        length, rest = geom.rows_per_owner, geom.rows_per_owner % 128
        if rest == 0:
            return f"64-row tiles only help slots ending in a half tile; L = {length} fills whole 128-row tiles"
        if rest > self.tile_mn[0]:
            return (f"64-row tiles only help slots ending in a half tile; L = {length} ends in {rest} rows of a "
                    "128-row tile")
        return super().supports(geom, dtype, device, has_window)


class FA4SplitTileKernel(FA4Kernel):
    """FA4 in two launches: every slot's whole 128-row tiles, then its tail rows on 64-row tiles.

    Where L = 128 k + r (0 < r <= 64) and the heads fill many waves (FLUX 1024², P = 8, all heads in one launch: L =
    576), FA4's one launch runs a half-empty last tile per slot: 40 x 8 x 5 = 1600 tiles for the work of 1440,
    slower than FA4 on the local layout. Here rows [0, 128 k) of every slot run on FA4's own 128-row tiles (no empty
    rows) and rows [128 k, L) on 64-row tiles (``fa4-m64``'s configuration, full there): the tail is 1/9 of the rows
    at 4608 / P = 8, so its slower tiles cost less than the empty halves did, if the second launch's partial wave
    does not eat the difference. It does not: measured below ``fa4-gqa`` on every shape it took
    (benchmarks/results/attention/NOTES.md, "fa4-gqa measured"); out of the default sweep, ask for it by name
    (``fused:fa4-split``). Refuses where the slots fill whole tiles, the tail is over half a tile, there is no whole
    tile, or S is not divisible by P (each owner's valid rows in the range would need their own ``seqused_q``).
    """

    name = "fa4-split"
    tail_tile_mn = (64, 128)

    def __init__(self, kv_mode: str = "auto"):
        from xstage_dit.ops.attention.fa4 import FA4WindowKernel

        super().__init__(kv_mode)
        self._tail = FA4WindowKernel(self.tail_tile_mn)

    def body_rows(self, geom: WindowGeometry) -> int:
        """Rows of each slot that fill whole 128-row tiles."""
        return geom.rows_per_owner - geom.rows_per_owner % 128

    def supports(self, geom, dtype, device, has_window) -> str | None:
        length, rest = geom.rows_per_owner, geom.rows_per_owner % 128
        if rest == 0:
            return f"a split only helps slots ending in a part tile; L = {length} fills whole 128-row tiles"
        if rest > self.tail_tile_mn[0]:
            return f"a split only helps slots ending in at most half a tile; L = {length} ends in {rest} rows"
        if length < 128:
            return f"a split needs at least one whole 128-row tile per slot, got L = {length}"
        if geom.seq_len % geom.world_size:
            return f"a split takes S divisible by P, got S={geom.seq_len}, P={geom.world_size}"
        return super().supports(geom, dtype, device, has_window)

    def run(self, q, k, v, target: OutTarget, geom: WindowGeometry, scale: float) -> None:
        body = self.body_rows(geom)
        self._impl.run(q, k, v, target.view, geom, scale, kv_mode=self.kv_mode, rows=(0, body))
        self._tail.run(q, k, v, target.view, geom, scale, kv_mode=self.kv_mode, rows=(body, geom.rows_per_owner))


class FA4OwnerHeadsKernel(FA4Kernel):
    """FA4 with the window's P owner blocks as P query heads of one KV head (GQA), the rank's heads as the batch.

    The owner-batch launch (``fa4``) runs P slots of L rows: where L ends in a part tile every slot runs one (FLUX
    1024², P = 8: L = 576, slower than plain FA4 on the local layout), and its tile order visits one head's K/V once
    per owner block. As GQA query heads, FA4 packs the owners' rows into its M tiles (``pack_gqa``): S / 128 full
    tiles a head, in plain FA4's order, each tile's rows stored to their owners through the same window view
    (permuted, no copy). Measured faster than cuDNN on every shape of the window table, and than the owner-batch
    launch at 4608 / P = 8 (benchmarks/results/attention/NOTES.md, "fa4-gqa measured"): swept by default
    (``schedule.attention_kernel.DEFAULT_ORDER``). Refuses S not divisible by P (each owner's valid rows would need
    a ``seqused_q`` per query head).
    """

    name = "fa4-gqa"

    def supports(self, geom, dtype, device, has_window) -> str | None:
        if geom.seq_len % geom.world_size:
            return f"owners as query heads take S divisible by P, got S={geom.seq_len}, P={geom.world_size}"
        return super().supports(geom, dtype, device, has_window)

    def run(self, q, k, v, target: OutTarget, geom: WindowGeometry, scale: float) -> None:
        self._impl.run_owner_heads(q, k, v, target.view, geom, scale)


class FA4OwnerHeadsUnpackedKernel(FA4OwnerHeadsKernel):
    """``fa4-gqa`` without packing (``pack_gqa=False``), for slots of whole 128-row tiles.

    Where L is a multiple of 128 packing has no part tiles to fill, and unpacked the launch is plain FA4's work in
    plain FA4's order: per rank head, owner after owner, each owner's L / 128 tiles against the head's K/V (hot in
    L2 across the owners), each tile stored whole into its owner's slot. Packed, every tile gathers rows of P owners
    (128 / P each). Why it exists: at 32K (L a multiple of 128) the packed launch and the owner-batch launch
    measured slower than plain FA4 on the local layout by more than issue 14's 2 % residual target
    (``residual_fa4gqa_pct``, ``residual_fa4_pct``); unpacked, it was the fastest window kernel on several rows from
    16K (benchmarks/results/attention/NOTES.md, "fa4-gqa-unpacked measured"): swept by default
    (``schedule.attention_kernel.DEFAULT_ORDER``; the benchmark's ``fa4gqaunpacked_window`` column). Refuses slots
    ending in a part tile (``fa4-gqa`` packs those).
    """

    name = "fa4-gqa-unpacked"

    def supports(self, geom, dtype, device, has_window) -> str | None:
        if geom.rows_per_owner % 128:
            return (f"unpacked owner heads only help slots of whole 128-row tiles; L = {geom.rows_per_owner} ends "
                    f"in {geom.rows_per_owner % 128} rows (fa4-gqa packs those)")
        return super().supports(geom, dtype, device, has_window)

    def run(self, q, k, v, target: OutTarget, geom: WindowGeometry, scale: float) -> None:
        self._impl.run_owner_heads(q, k, v, target.view, geom, scale, pack_gqa=False)


class CudnnKernel:
    """cuDNN SDPA through cudnn-frontend's graph API with the window as O (``cudnn_fe.py``)."""

    name = "cudnn"

    def __init__(self):
        from xstage_dit.ops.attention.cudnn_fe import CudnnWindowKernel

        self._impl = CudnnWindowKernel()

    def supports(self, geom, dtype, device, has_window) -> str | None:
        return self._impl.supports(geom, dtype, device, has_window)

    def run(self, q, k, v, target: OutTarget, geom: WindowGeometry, scale: float) -> None:
        self._impl.run(q, k, v, target.view, geom, scale)


KERNELS = {"fa4": FA4Kernel, "fa4-m64": FA4HalfTileKernel, "fa4-split": FA4SplitTileKernel,
           "fa4-gqa": FA4OwnerHeadsKernel, "fa4-gqa-unpacked": FA4OwnerHeadsUnpackedKernel, "cudnn": CudnnKernel,
           "triton": TritonTableKernel,
           # the 8-bit kernels, by the one list of their names (schedule.attention_kernel.FP8_KERNELS)
           **{name: FP8_KERNEL_CLASSES[name] for name in FP8_KERNELS}}
# The kernels the sweep times and, where nothing was measured, their order of preference: DEFAULT_ORDER, owned
# by `schedule.attention_kernel` (the chooser reads the same tuple). fa4-m64 is not swept by default: it
# measured below FA4's own 128-row tiles on every half-tile slot it takes; nor is fa4-split (below fa4-gqa on
# every shape it took). The tables: benchmarks/results/attention/ (h200-4135c19-graph.md, h200-44c49d2-graph.md).
# Ask for either by name ("fused:fa4-m64").


def make_kernel(name: str, **kwargs):
    """A fresh kernel object by name (``fa4``, ``fa4-m64``, ``fa4-split``, ``fa4-gqa``, ``fa4-gqa-unpacked``,
    ``cudnn``, ``triton``, and the 8-bit ``cudnn-fp8``, ``sage``)."""
    if name not in KERNELS:
        raise ValueError(f"expected a kernel in {sorted(KERNELS)}, got {name!r}")
    return KERNELS[name](**kwargs)


def refusals(geom: WindowGeometry, dtype: torch.dtype, device: torch.device, has_window: bool,
             names=DEFAULT_ORDER) -> dict[str, str | None]:
    """Every kernel's answer for one problem: None (takes it) or the reason it refuses."""
    return {name: make_kernel(name).supports(geom, dtype, device, has_window) for name in names}


def kernel_versions() -> dict[str, object]:
    """The version of every library whose kernels the sweep times (part of its cache key): torch, triton,
    torch's cuDNN, flash-attn-4, cudnn-frontend and the cuDNN it runs on, sageattention (None where missing)."""
    from importlib import metadata

    from xstage_dit.ops.attention import cudnn_fe, fa4, sage

    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = None
    return {"torch": torch.__version__, "triton": triton,
            "torch_cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "flash_attn_4": fa4.version(), "cudnn_frontend": cudnn_fe.PINNED if cudnn_fe.available() is None else None,
            "cudnn_frontend_backend": cudnn_fe.backend_version(), "sageattention": sage.version()}
