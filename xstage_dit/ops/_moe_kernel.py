"""Triton device code of the expert-parallel MoE: persistent expert MLP with remote combine, row push
(dispatch) and the combine-reduce. Device code only; shapes are checked by the launchers in
``moe_combine.py``.

Pointer tables: ``table_ptr`` is an int64[world] array whose entry ``r`` is the address of rank ``r``'s
buffer (a symmetric-memory peer table, or a local table for world 1 / virtual ranks); entries are cast
to the element pointer type and stored through, exactly like a peer mapping.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _moe_mlp_combine_kernel(
    x_ptr,  # (rows, H) expert-major dispatched rows
    w1_ptr,  # (E_local, H, 2I): gate columns [0, I), up columns [I, 2I)
    w2_ptr,  # (E_local, I, H)
    h_ptr,  # (rows, I) SwiGLU output (scratch)
    table_ptr,  # int64[world]: combine buffer of each rank, (slots, H) with row stride stride_om
    dest_rank_ptr,  # int32[rows]
    dest_row_ptr,  # int32[rows]
    row_w_ptr,  # fp32[rows] router weight
    tiles_ptr,  # int32 (num_tiles, 3): (kind, block, n)
    blocks_ptr,  # int32 (num_blocks, 3): (expert, row_start, row_end)
    sync_ptr,  # int32[1 + num_blocks], zero at launch: [0] = tile ticket, [1 + b] = finished L1 tiles of b
    num_tiles,
    stride_xm,
    stride_w1e,
    stride_w1k,
    stride_w1n,
    stride_hm,
    stride_w2e,
    stride_w2k,
    stride_w2n,
    stride_om,
    H: tl.constexpr,  # constexpr: static GEMM loops (and the interpreter takes no run-time range bounds)
    I: tl.constexpr,
    N1: tl.constexpr,
    BM: tl.constexpr,
    BN1: tl.constexpr,
    BN2: tl.constexpr,
    BK: tl.constexpr,
):
    out_ty = h_ptr.dtype.element_ty
    # Tiles are taken in array order through one ticket: a program waiting on block b's counter waits on
    # Linear-1 tiles that earlier tickets already handed to running programs, so progress is guaranteed.
    t = tl.atomic_add(sync_ptr, 1)
    while t < num_tiles:
        kind = tl.load(tiles_ptr + t * 3)
        b = tl.load(tiles_ptr + t * 3 + 1)
        n = tl.load(tiles_ptr + t * 3 + 2)
        e = tl.load(blocks_ptr + b * 3).to(tl.int64)
        row_start = tl.load(blocks_ptr + b * 3 + 1)
        row_end = tl.load(blocks_ptr + b * 3 + 2)
        offs_m = row_start + tl.arange(0, BM)
        mask_m = offs_m < row_end
        offs_k0 = tl.arange(0, BK)
        if kind == 0:
            # Linear-1 of intermediate columns [n*BN1, (n+1)*BN1): gate and up in one tile so the
            # epilogue has both and SwiGLU never makes a separate pass over memory.
            offs_n = n * BN1 + tl.arange(0, BN1)
            mask_n = offs_n < I
            acc_g = tl.zeros((BM, BN1), dtype=tl.float32)
            acc_u = tl.zeros((BM, BN1), dtype=tl.float32)
            a_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k0[None, :]
            wg_ptrs = w1_ptr + e * stride_w1e + offs_k0[:, None] * stride_w1k + offs_n[None, :] * stride_w1n
            wu_ptrs = wg_ptrs + I * stride_w1n
            for k in range(0, H, BK):
                mask_k = (offs_k0 + k) < H
                a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                wg = tl.load(wg_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
                wu = tl.load(wu_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
                acc_g = tl.dot(a, wg, acc_g)
                acc_u = tl.dot(a, wu, acc_u)
                a_ptrs += BK
                wg_ptrs += BK * stride_w1k
                wu_ptrs += BK * stride_w1k
            hval = acc_g * tl.sigmoid(acc_g) * acc_u
            h_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_n[None, :]
            tl.store(h_ptrs, hval.to(out_ty), mask=mask_m[:, None] & mask_n[None, :])
            # Every thread's stores happen before the one releasing increment.
            tl.debug_barrier()
            tl.atomic_add(sync_ptr + 1 + b, 1, sem="release", scope="gpu")
        else:
            done = tl.atomic_add(sync_ptr + 1 + b, 0, sem="acquire", scope="gpu")
            while done < N1:
                done = tl.atomic_add(sync_ptr + 1 + b, 0, sem="acquire", scope="gpu")
            tl.debug_barrier()
            offs_n = n * BN2 + tl.arange(0, BN2)
            mask_n = offs_n < H
            acc = tl.zeros((BM, BN2), dtype=tl.float32)
            h_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_k0[None, :]
            w_ptrs = w2_ptr + e * stride_w2e + offs_k0[:, None] * stride_w2k + offs_n[None, :] * stride_w2n
            for k in range(0, I, BK):
                mask_k = (offs_k0 + k) < I
                hv = tl.load(h_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                wv = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
                acc = tl.dot(hv, wv, acc)
                h_ptrs += BK
                w_ptrs += BK * stride_w2k
            # Epilogue: router weight, then each row straight into its source rank's combine buffer.
            row_w = tl.load(row_w_ptr + offs_m, mask=mask_m, other=0.0)
            out = (acc * row_w[:, None]).to(out_ty)
            dst_rank = tl.load(dest_rank_ptr + offs_m, mask=mask_m, other=0)
            dst_row = tl.load(dest_row_ptr + offs_m, mask=mask_m, other=0)
            base = tl.load(table_ptr + dst_rank, mask=mask_m, other=0).to(tl.pointer_type(out_ty))
            o_ptrs = base[:, None] + (dst_row[:, None].to(tl.int64) * stride_om + offs_n[None, :])
            tl.store(o_ptrs, out, mask=mask_m[:, None] & mask_n[None, :])
        t = tl.atomic_add(sync_ptr, 1)


@triton.jit
def _push_rows_kernel(
    src_ptr,  # (n_src, C) rows to send
    src_idx_ptr,  # int32[n]: source row of each pushed row
    table_ptr,  # int64[world]: destination buffer of each rank, row stride stride_dm
    dest_rank_ptr,  # int32[n]
    dest_row_ptr,  # int32[n]
    n,
    C,
    stride_sm,
    stride_dm,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    elem_ty = src_ptr.dtype.element_ty
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask_r = offs_r < n
    mask = mask_r[:, None] & (offs_c[None, :] < C)
    src_row = tl.load(src_idx_ptr + offs_r, mask=mask_r, other=0).to(tl.int64)
    vals = tl.load(src_ptr + src_row[:, None] * stride_sm + offs_c[None, :], mask=mask, other=0)
    dst_rank = tl.load(dest_rank_ptr + offs_r, mask=mask_r, other=0)
    dst_row = tl.load(dest_row_ptr + offs_r, mask=mask_r, other=0).to(tl.int64)
    base = tl.load(table_ptr + dst_rank, mask=mask_r, other=0).to(tl.pointer_type(elem_ty))
    tl.store(base[:, None] + (dst_row[:, None] * stride_dm + offs_c[None, :]), vals, mask=mask)


@triton.jit
def _combine_reduce_kernel(
    buf_ptr,  # (slots, C) combine buffer
    slot_offsets_ptr,  # int32[tokens + 1]
    slots_ptr,  # int32[num_slots]: buffer rows of each token, token-major
    shared_ptr,  # (tokens, C) shared-expert output (or a zero-stride dummy when HAS_SHARED is False)
    out_ptr,  # (tokens, C)
    C,
    stride_bm,
    stride_sm,
    stride_om,
    HAS_SHARED: tl.constexpr,
    BC: tl.constexpr,
):
    tok = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    acc = tl.zeros((BC,), dtype=tl.float32)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + tok.to(tl.int64) * stride_sm + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    start = tl.load(slot_offsets_ptr + tok)
    end = tl.load(slot_offsets_ptr + tok + 1)
    # A while loop: run-time range() bounds are not supported by the interpreter with numpy >= 2.4.
    j = start
    while j < end:
        slot = tl.load(slots_ptr + j).to(tl.int64)
        acc += tl.load(buf_ptr + slot * stride_bm + offs_c, mask=mask_c, other=0.0).to(tl.float32)
        j += 1
    tl.store(out_ptr + tok.to(tl.int64) * stride_om + offs_c, acc.to(out_ptr.dtype.element_ty), mask=mask_c)
