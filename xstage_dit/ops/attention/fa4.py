"""FlashAttention-4 (``flash-attn-4``, CuTe DSL) writing the post-attention All-to-All through the peer window.

The only module that touches ``flash_attn.cute``: its ``_flash_attn_fwd(q, k, v, out=..., page_table=...,
seqused_q=..., seqused_k=...)`` is private API, so the version is pinned (``PINNED``, the ``gpu`` extra)
and checked before first use with a clear error.

On rank r (heads h0 .. h0+Hr), per ``window.py``:

- Q is the owner-batch view (B*P, L, Hr, D) of the gathered (B, >= P*L, Hr, D) q;
- K/V are shared by the P owner blocks of one batch element: a stride-0 batch (B*P == P, one launch per
  batch element when B > 1), or with B > 1 and P*L a multiple of the page size, one launch with a page
  table whose rows for batch b all list batch b's pages;
- ``out`` is the window view at the rank's head offset; ``seqused_q`` gives each block its owner's valid
  rows, so padding rows (S not divisible by P) are never written into a peer's buffer; ``seqused_k = S``
  masks the zero rows that pad K/V to whole pages.
"""

from __future__ import annotations

import functools
from importlib import metadata

import torch

from xstage_dit.ops.attention.window import WindowGeometry, owner_batch_strides

PINNED = "4.0.0b36"
DISTRIBUTION = "flash-attn-4"
PAGE_SIZE = 128  # FA4's Hopper tile_n at head_dim <= 128: pages of one tile take its TMA path
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)


class FA4Unavailable(RuntimeError):
    """flash-attn-4 is missing or not the pinned version."""


@functools.cache
def _fwd():
    """``_flash_attn_fwd`` of the pinned flash-attn-4 (raises FA4Unavailable otherwise)."""
    try:
        version = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError as exc:
        raise FA4Unavailable(f"expected {DISTRIBUTION}=={PINNED} (pip install 'xstage-dit[gpu]'), got none") from exc
    if version != PINNED:
        raise FA4Unavailable(f"expected {DISTRIBUTION}=={PINNED} (its _flash_attn_fwd is private API), got {version}")
    try:
        from flash_attn.cute.interface import _flash_attn_fwd
    except Exception as exc:  # noqa: BLE001 - an install that does not import (e.g. the CuTe DSL without its
        # CUDA-toolkit flavour raises RuntimeError at import) is an unavailable kernel, with the reason
        raise FA4Unavailable(f"expected {DISTRIBUTION}=={PINNED} to import, got {type(exc).__name__}: {exc}") from exc
    return _flash_attn_fwd


def available() -> str | None:
    """None when the pinned FA4 imports, else the reason."""
    try:
        _fwd()
    except (FA4Unavailable, ImportError) as exc:
        return str(exc)
    return None


def version() -> str | None:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def supports(geom: WindowGeometry, dtype: torch.dtype, device: torch.device, has_window: bool) -> str | None:
    """Why FA4 cannot take this problem, or None."""
    if not has_window:
        return "FA4 writes a strided out tensor: it needs the peer window (not a pointer table)"
    if device.type != "cuda":
        return f"FA4 needs a CUDA device, got {device}"
    major, _ = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"FA4 through the window is checked on Hopper (sm_90) only, got sm_{major}x"
    if dtype not in DTYPES:
        return f"FA4 takes float16/bfloat16, got {dtype}"
    if geom.head_dim not in HEAD_DIMS:
        return f"FA4 through the window is checked at head_dim {HEAD_DIMS}, got {geom.head_dim}"
    return available()


def _check_shapes(q: torch.Tensor, out: torch.Tensor, geom: WindowGeometry) -> tuple[int, int, int, int]:
    """q's (B, rows_in, Hr, D), after checking q holds P*L rows and out is the (B*P, L, Hr, D) window view."""
    batch, rows_in, hr, d = q.shape
    p, length = geom.world_size, geom.rows_per_owner
    if rows_in < p * length:
        raise ValueError(f"expected q with >= P*L = {p * length} rows, got {rows_in}")
    if out.shape != (batch * p, length, hr, d):
        raise ValueError(f"expected out of shape {(batch * p, length, hr, d)}, got {tuple(out.shape)}")
    return batch, rows_in, hr, d


class FA4WindowKernel:
    """``run(q, k, v, out, geom, scale)``; caches the small int32 tensors (seqused, page table) per shape.

    tile_mn: FA4's (tile_m, tile_n) override, or None for its own heuristic (128 x 128 on Hopper at
    head_dim <= 128). (64, 128) runs one MMA warpgroup per CTA on 64-row tiles: for window slots whose
    L ends in a half tile (FLUX 1024² at P = 8: L = 576 = 4.5 x 128) it launches no half-empty tiles.
    """

    name = "fa4"

    def __init__(self, tile_mn: tuple[int, int] | None = None):
        self._aux: dict[tuple, dict[str, torch.Tensor]] = {}
        self._tiles = {} if tile_mn is None else {"tile_mn": tuple(tile_mn)}

    def supports(self, geom, dtype, device, has_window) -> str | None:
        return supports(geom, dtype, device, has_window)

    def _aux_for(self, geom: WindowGeometry, rows_in: int, paged: bool, device: torch.device) -> dict:
        key = (geom, rows_in, paged, str(device))
        aux = self._aux.get(key)
        if aux is None:
            aux = {}
            if geom.seq_len % geom.world_size:
                aux["seqused_q"] = torch.tensor(geom.seqused_q(), dtype=torch.int32, device=device)
            if paged:
                pages_per_batch = rows_in // PAGE_SIZE
                kv_pages = -(-geom.seq_len // PAGE_SIZE)
                # Row b*P + o lists batch b's pages: every owner block of a batch attends the same keys.
                table = [[b * pages_per_batch + j for j in range(kv_pages)]
                         for b in range(geom.batch) for _ in range(geom.world_size)]
                aux["page_table"] = torch.tensor(table, dtype=torch.int32, device=device)
                aux["seqused_k"] = torch.full((geom.num_slots,), geom.seq_len, dtype=torch.int32, device=device)
            self._aux[key] = aux
        return aux

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, geom: WindowGeometry,
            scale: float, *, kv_mode: str = "auto", rows: tuple[int, int] | None = None) -> None:
        """q, k, v: (B, rows_in >= P*L, Hr, D), rows [0, S) the whole sequence in token order, padding rows 0.
        out: (B*P, L, Hr, D) window view. kv_mode: "stride0" | "paged" | "auto" (paged where one launch can).
        rows: (r0, r1) computes only rows [r0, r1) of every owner slot (S divisible by P), None all L rows.
        """
        fwd = _fwd()
        batch, rows_in, hr, d = _check_shapes(q, out, geom)
        p, length, s = geom.world_size, geom.rows_per_owner, geom.seq_len
        r0, r1 = (0, length) if rows is None else rows
        if not 0 <= r0 < r1 <= length:
            raise ValueError(f"expected rows (r0, r1) with 0 <= r0 < r1 <= L = {length}, got {rows}")
        if rows is not None and s % p:
            # Each owner's valid rows inside the range would need their own seqused_q: not taken.
            raise ValueError(f"expected S divisible by P for a row range, got S={s}, P={p}")
        n, skip = r1 - r0, r0 * q.stride(1)
        uniform = owner_batch_strides(q.stride(0), q.stride(1), q.stride(2), p, length, batch)
        pageable = (uniform is not None and rows_in % PAGE_SIZE == 0 and k.stride() == v.stride()
                    and k.stride(0) == rows_in * k.stride(1))
        paged = kv_mode == "paged" or (kv_mode == "auto" and batch > 1 and pageable)
        if paged and not pageable:
            raise ValueError("expected P*L rows in whole pages and one batch stride for the paged K/V mode")
        aux = self._aux_for(geom, rows_in, paged, q.device)
        if paged:
            q_ob = q.as_strided((batch * p, n, hr, d), uniform, q.storage_offset() + skip)
            npages = batch * rows_in // PAGE_SIZE
            kv_strides = (PAGE_SIZE * k.stride(1), k.stride(1), k.stride(2), 1)
            k_pages = k.as_strided((npages, PAGE_SIZE, hr, d), kv_strides, k.storage_offset())
            v_pages = v.as_strided((npages, PAGE_SIZE, hr, d), kv_strides, v.storage_offset())
            fwd(q_ob, k_pages, v_pages, page_table=aux["page_table"], seqused_k=aux["seqused_k"],
                seqused_q=aux.get("seqused_q"), softmax_scale=scale, out=out[:, r0:r1], **self._tiles)
            return
        block = (length * q.stride(1), q.stride(1), q.stride(2), 1)
        seqused = aux.get("seqused_q")
        for b in range(batch):
            # One launch per batch element: the P owner blocks share this element's K/V as a stride-0 batch.
            q_ob = q.as_strided((p, n, hr, d), block, q.storage_offset() + b * q.stride(0) + skip)
            kb = k[b, :s].unsqueeze(0).expand(p, s, hr, d)
            vb = v[b, :s].unsqueeze(0).expand(p, s, hr, d)
            fwd(q_ob, kb, vb, seqused_q=None if seqused is None else seqused[b * p:(b + 1) * p],
                softmax_scale=scale, out=out[b * p:(b + 1) * p, r0:r1], **self._tiles)

    def run_owner_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        geom: WindowGeometry, scale: float, *, pack_gqa: bool | None = None) -> None:
        """The same problem as `run`, launched with the owner blocks as GQA query heads and the rank's Hr heads
        as the batch: Q (Hr, L, B*P, D) (query head b*P + o: batch element b's owner o), K/V (Hr, S, B, D) (KV
        head b: P query heads each), out the window view (B*P, L, Hr, D) permuted to (Hr, L, B*P, D). FA4's
        GQA path packs each KV head's P owners into its M tiles (``pack_gqa``, its default for P > 1): S / 128
        tiles a head, as plain FA4 on the local layout, instead of P slots of L rows each ending in a part
        tile, and all of one head's tiles in one stretch of the launch (its K/V hot in L2).

        One launch where q's batch stride is P*L rows (the window path's input buffer, or a plain (B, S, H, D)
        at P = 1), so (b, o) is one head index; else one launch per batch element. S must be divisible by P (no
        per-owner ``seqused_q`` in this layout)."""
        fwd = _fwd()
        batch, _, hr, d = _check_shapes(q, out, geom)
        p, length, s = geom.world_size, geom.rows_per_owner, geom.seq_len
        if s % p:
            raise ValueError(f"expected S divisible by P for owners as heads, got S={s}, P={p}")
        sq_row, sq_head = q.stride(1), q.stride(2)
        merged = batch == 1 or q.stride(0) == p * length * sq_row
        groups = [(0, batch)] if merged else [(b, 1) for b in range(batch)]
        for b0, n in groups:
            qg = q.as_strided((hr, length, n * p, d), (sq_head, sq_row, length * sq_row, 1),
                              q.storage_offset() + b0 * q.stride(0))
            kg, vg = (t.as_strided((hr, s, n, d), (t.stride(2), t.stride(1), t.stride(0), 1),
                                   t.storage_offset() + b0 * t.stride(0)) for t in (k, v))
            fwd(qg, kg, vg, softmax_scale=scale, out=out[b0 * p:(b0 + n) * p].permute(2, 1, 0, 3), pack_gqa=pack_gqa,
                **self._tiles)

    def run_plain(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """Plain FA4 on (B, S, H, D) tensors, writing a local (B, S, H, D) output (the benchmark's column)."""
        return _fwd()(q, k, v, softmax_scale=scale, out=out, **self._tiles)[0]
