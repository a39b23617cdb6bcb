"""Triton device code of the expert-parallel MoE: persistent expert MLP with remote combine, row push
(dispatch) and the combine-reduce. Device code only; shapes are checked by the launchers in
``fused.py``.

Pointer tables: ``table_ptr`` is an int64[world] array whose entry ``r`` is the address of rank ``r``'s
buffer (a symmetric-memory peer table, or a local table for world 1 / virtual ranks); entries are cast
to the element pointer type and stored through, exactly like a peer mapping.
"""

from __future__ import annotations

import triton
import triton.language as tl


# Per-call counts (tiles, rows) depend on the routing: specialised on divisibility by 16 they would compile a
# new kernel each time a call's counts land in a new residue class (seconds each, paid by whichever request
# first routes that way), so they are plain run-time ints.
@triton.jit(do_not_specialize=["num_tiles", "num_rows"])
def _moe_mlp_combine_kernel(
    x_ptr,  # (rows, H) expert-major dispatched rows
    w1_ptr,  # (E_local, H, 2I): gate columns [0, I), up columns [I, 2I)
    w2_ptr,  # (E_local, I, H)
    h_ptr,  # (rows, I) SwiGLU output (scratch)
    comb_base_ptr,  # any 16-byte aligned pointer of the combine dtype: the origin of table_ptr's offsets
    table_ptr,  # int64[world]: combine buffer of each rank as an element offset from comb_base_ptr
    dest_rank_ptr,  # int32[rows]
    dest_row_ptr,  # int32[rows]
    row_w_ptr,  # fp32[rows] router weight
    tiles_ptr,  # int32 (num_tiles, 3): (kind, block, n)
    blocks_ptr,  # int32 (num_blocks, 3): (expert, row_start, row_end)
    sync_ptr,  # int32[1 + num_blocks], zero at launch: [0] = tile ticket, [1 + b] = finished L1 tiles of b
    num_tiles,
    num_rows,  # rows of x and h (the row extent of their tensor descriptors)
    num_experts,  # E_local (the row extent of the flattened weight descriptors)
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
    ELEM_BYTES: tl.constexpr,
    BM: tl.constexpr,
    BN1: tl.constexpr,
    BN2: tl.constexpr,
    BK: tl.constexpr,
    TICKET: tl.constexpr,
    USE_DESC: tl.constexpr,  # TMA tensor-descriptor loads of x, w1, h, w2 (sm_90+; needs triton.set_allocator)
    PROXY_FENCE: tl.constexpr = False,  # USE_DESC on a GPU: fence.proxy.async.global before TMA reads of h
):
    out_ty = h_ptr.dtype.element_ty
    if USE_DESC:
        # No warp specialization: Triton 3.6's Hopper pass only partitions a top-level loop at 4 warps; a K loop
        # inside this persistent while loop is left alone (8 warps, or 4 under an if) or aborts the compile
        # (4 warps, directly in the while: "Other parent ops are not supported", TaskIdPropagation.cpp).
        # Made once per program, over whole tensors: a per-tile descriptor per expert would put a tensormap
        # write and proxy fence on every tile's critical path. The weights are viewed as (E*K, N) (the
        # launcher checks the expert stride is K rows). What a box reads past a block's own rows or K
        # range is harmless or zero (see the loads); columns and rows past the tensors read as zeros.
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[num_rows, H], strides=[stride_xm, 1], block_shape=[BM, BK])
        wg_desc = tl.make_tensor_descriptor(w1_ptr, shape=[num_experts * H, I], strides=[stride_w1k, 1],
                                            block_shape=[BK, BN1])
        # Up columns as their own (E*H, I) view: a partial last gate block reads zeros, not up columns.
        wu_desc = tl.make_tensor_descriptor(w1_ptr + I, shape=[num_experts * H, I], strides=[stride_w1k, 1],
                                            block_shape=[BK, BN1])
        h_desc = tl.make_tensor_descriptor(h_ptr, shape=[num_rows, I], strides=[stride_hm, 1], block_shape=[BM, BK])
        w2_desc = tl.make_tensor_descriptor(w2_ptr, shape=[num_experts * I, H], strides=[stride_w2k, 1],
                                            block_shape=[BK, BN2])
    # TICKET: tiles are taken in array order through one atomic ticket: a program waiting on block b's
    # counter waits on Linear-1 tiles that earlier tickets already handed to running programs, so
    # progress is guaranteed whatever is resident. Otherwise a static stride (tile pid, pid + G, ...):
    # no atomic per tile, deadlock-free only when all G programs are resident together (grid <= SMs,
    # one program per SM) - or G == 1, as the launcher uses under the interpreter.
    if TICKET:
        t = tl.atomic_add(sync_ptr, 1)
    else:
        t = tl.program_id(0)
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
        # Names differ between the branches: Triton merges same-named values of an if/else by type.
        if kind == 0:
            # Linear-1 of intermediate columns [n*BN1, (n+1)*BN1): gate and up in one tile so the
            # epilogue has both and SwiGLU never makes a separate pass over memory.
            offs_n1 = n * BN1 + tl.arange(0, BN1)
            mask_n1 = offs_n1 < I
            acc_g = tl.zeros((BM, BN1), dtype=tl.float32)
            acc_u = tl.zeros((BM, BN1), dtype=tl.float32)
            if USE_DESC:
                # Rows past row_end (a partial last block of an expert) are the next expert's rows: their
                # results land only in rows the masked stores drop (a GEMM row depends on its own A row).
                # K past H: x reads zeros there; the weight box reads the next expert's first rows, zeroed
                # when H % BK != 0 so that even non-finite weights cannot leak in.
                e1 = e.to(tl.int32)
                n1_col = n * BN1
                for k1d in range(0, H, BK):
                    a_d = x_desc.load([row_start, k1d])
                    wg_d = wg_desc.load([e1 * H + k1d, n1_col])
                    wu_d = wu_desc.load([e1 * H + k1d, n1_col])
                    if H % BK != 0:
                        in_k1 = (offs_k0 + k1d) < H
                        wg_d = tl.where(in_k1[:, None], wg_d, 0.0)
                        wu_d = tl.where(in_k1[:, None], wu_d, 0.0)
                    acc_g = tl.dot(a_d, wg_d, acc_g)
                    acc_u = tl.dot(a_d, wu_d, acc_u)
            else:
                a1_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k0[None, :]
                wg_ptrs = w1_ptr + e * stride_w1e + offs_k0[:, None] * stride_w1k + offs_n1[None, :] * stride_w1n
                wu_ptrs = wg_ptrs + I * stride_w1n
                for k1 in range(0, H, BK):
                    mask_k1 = (offs_k0 + k1) < H
                    a = tl.load(a1_ptrs, mask=mask_m[:, None] & mask_k1[None, :], other=0.0)
                    wg = tl.load(wg_ptrs, mask=mask_k1[:, None] & mask_n1[None, :], other=0.0)
                    wu = tl.load(wu_ptrs, mask=mask_k1[:, None] & mask_n1[None, :], other=0.0)
                    acc_g = tl.dot(a, wg, acc_g)
                    acc_u = tl.dot(a, wu, acc_u)
                    a1_ptrs += BK
                    wg_ptrs += BK * stride_w1k
                    wu_ptrs += BK * stride_w1k
            h1_val = acc_g * tl.sigmoid(acc_g) * acc_u
            h1_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_n1[None, :]
            tl.store(h1_ptrs, h1_val.to(out_ty), mask=mask_m[:, None] & mask_n1[None, :])
            # Every thread's stores happen before the one releasing increment.
            tl.debug_barrier()
            tl.atomic_add(sync_ptr + 1 + b, 1, sem="release", scope="gpu")
        else:
            done2 = tl.atomic_add(sync_ptr + 1 + b, 0, sem="acquire", scope="gpu")
            while done2 < N1:
                done2 = tl.atomic_add(sync_ptr + 1 + b, 0, sem="acquire", scope="gpu")
            if PROXY_FENCE:
                # h was written by other programs with ordinary (generic-proxy) stores and is read below by
                # TMA (the async proxy): the acquire orders generic accesses only, so without this proxy
                # fence the TMA loads may see stale rows (PTX memory model; cf. deepseek-ai/DeepEP#642).
                tl.inline_asm_elementwise("fence.proxy.async.global; mov.b32 $0, $1;", "=r,r", [done2],
                                          dtype=tl.int32, is_pure=False, pack=1)
            tl.debug_barrier()
            offs_n2 = n * BN2 + tl.arange(0, BN2)
            mask_n2 = offs_n2 < H
            acc2 = tl.zeros((BM, BN2), dtype=tl.float32)
            if USE_DESC:
                # As in Linear-1: extra rows only reach dropped rows; K past I reads zeros from h.
                e2 = e.to(tl.int32)
                n2_col = n * BN2
                for k2d in range(0, I, BK):
                    h2_d = h_desc.load([row_start, k2d])
                    w2_d = w2_desc.load([e2 * I + k2d, n2_col])
                    if I % BK != 0:
                        w2_d = tl.where(((offs_k0 + k2d) < I)[:, None], w2_d, 0.0)
                    acc2 = tl.dot(h2_d, w2_d, acc2)
            else:
                h2_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_k0[None, :]
                w2_ptrs = w2_ptr + e * stride_w2e + offs_k0[:, None] * stride_w2k + offs_n2[None, :] * stride_w2n
                for k2 in range(0, I, BK):
                    mask_k2 = (offs_k0 + k2) < I
                    h2v = tl.load(h2_ptrs, mask=mask_m[:, None] & mask_k2[None, :], other=0.0)
                    w2v = tl.load(w2_ptrs, mask=mask_k2[:, None] & mask_n2[None, :], other=0.0)
                    acc2 = tl.dot(h2v, w2v, acc2)
                    h2_ptrs += BK
                    w2_ptrs += BK * stride_w2k
            # Epilogue: router weight, then each row straight into its source rank's combine buffer.
            row_w2 = tl.load(row_w_ptr + offs_m, mask=mask_m, other=0.0)
            out2 = (acc2 * row_w2[:, None]).to(out_ty)
            dst_rank2 = tl.load(dest_rank_ptr + offs_m, mask=mask_m, other=0)
            dst_row2 = tl.load(dest_row_ptr + offs_m, mask=mask_m, other=0)
            # Row start in the destination rank's buffer, in elements from comb_base_ptr. Buffers and rows
            # are 16-byte aligned (checked by the launcher); saying so gives 16-byte remote stores.
            row_off = tl.load(table_ptr + dst_rank2, mask=mask_m, other=0) + dst_row2.to(tl.int64) * stride_om
            row_off = tl.multiple_of(row_off, 16 // ELEM_BYTES)
            o2_ptrs = comb_base_ptr + (row_off[:, None] + offs_n2[None, :])
            tl.store(o2_ptrs, out2, mask=mask_m[:, None] & mask_n2[None, :])
        if TICKET:
            t = tl.atomic_add(sync_ptr, 1)
        else:
            t += tl.num_programs(0)


@triton.jit(do_not_specialize=["n"])
def _push_rows_kernel(
    src_ptr,  # (n_src, C) rows to send
    src_idx_ptr,  # int32[n]: source row of each pushed row
    table_ptr,  # int64[world]: destination buffer of each rank as an element offset from src_ptr
    dest_rank_ptr,  # int32[n]
    dest_row_ptr,  # int32[n]
    n,
    C,
    stride_sm,
    stride_dm,
    ALIGN: tl.constexpr,  # elements every destination row start is a multiple of (16 bytes, or 1)
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask_r = offs_r < n
    mask = mask_r[:, None] & (offs_c[None, :] < C)
    src_row = tl.load(src_idx_ptr + offs_r, mask=mask_r, other=0).to(tl.int64)
    vals = tl.load(src_ptr + src_row[:, None] * stride_sm + offs_c[None, :], mask=mask, other=0)
    dst_rank = tl.load(dest_rank_ptr + offs_r, mask=mask_r, other=0)
    dst_row = tl.load(dest_row_ptr + offs_r, mask=mask_r, other=0).to(tl.int64)
    row_off = tl.multiple_of(tl.load(table_ptr + dst_rank, mask=mask_r, other=0) + dst_row * stride_dm, ALIGN)
    tl.store(src_ptr + (row_off[:, None] + offs_c[None, :]), vals, mask=mask)


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
