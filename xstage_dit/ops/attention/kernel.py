"""Triton FlashAttention forward whose epilogue stores each output tile through a destination table.

Device code only knows pointers, strides and sizes; `table.py` and the package `__init__` own the torch-facing API.

The kernel computes full (non-causal) attention for the heads held by this rank over the whole
(padded) sequence and writes output row `m` of local head `h` straight into the buffer of the rank
that owns token `m`:

    dest = m // seq_local, local_row = m - dest * seq_local
    out_table[dest] -> (batch, seq_local, heads_total, head_dim) buffer, element
    [b, local_row, head_offset + h, :]

With one destination and `seq_local = seq_len` this is ordinary attention writing locally. With a
symmetric-memory peer table it is attention with the post-attention All-to-All in its epilogue
("piggyback", DESIGN §2); with several local buffers it is the "virtual ranks" of tests/benchmarks.

`seq_local` need not be a multiple of BLOCK_M, so query tiles are numbered per owner shard (the last
tile of a shard may be partial): every tile has exactly one owner and leaves the kernel in one TMA
store through a descriptor spanning that owner's rows (the copy engine drops the partial tile's
extra rows). Costs at most one partial tile per shard and head. Two earlier designs failed on the
H200 with Triton 3.6 warp specialization: a second TMA store at a negative row coordinate for the
next owner (illegal-instruction fault), and plain stores for a straddling tile's later rows under a
run-time branch (wrong rows); the CPU interpreter had passed both.

Masking: only keys `< seq_len` take part (padding rows of the last ranks, and the bound of the
tensor descriptors, read as zeros and get -inf scores); the unmasked main loop runs over full key
tiles and one masked step (before the loop) handles the ragged tail, so the hot loop pays nothing
for the mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from xstage_dit.ops.triton_alloc import install_descriptor_allocator, interpreting

LOG2E = 1.4426950408889634


@triton.jit
def _kv_step(acc, l_i, m_i, q, start_n, desc_k, desc_v, K, V, stride_ks, stride_vs, seq_len, qk_scale,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASK_KV: tl.constexpr, USE_DESC: tl.constexpr,
             UPCAST_DOT: tl.constexpr):
    """One KV tile of the online softmax: keys/values [start_n, start_n + BLOCK_N).

    UPCAST_DOT (interpreter + bf16 only): the Triton 3.6 interpreter multiplies bf16 operands as their
    uint16 storage, so operands already rounded to bf16 are widened to fp32 (exact) before each dot.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if USE_DESC:
        k = desc_k.load([start_n, 0]).T
    else:
        kv_rows = start_n + offs_n
        k_ptrs = K + kv_rows[None, :] * stride_ks + offs_d[:, None]
        if MASK_KV:
            k = tl.load(k_ptrs, mask=kv_rows[None, :] < seq_len, other=0.0)
        else:
            k = tl.load(k_ptrs)
    if UPCAST_DOT:
        qk = tl.dot(q.to(tl.float32), k.to(tl.float32))
    else:
        qk = tl.dot(q, k)
    if MASK_KV:
        qk = tl.where((start_n + offs_n)[None, :] < seq_len, qk, float("-inf"))
    # exp2 with the log2(e) folded into the scale: one FFMA per score (scale, subtract max).
    m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    qk = qk * qk_scale - m_ij[:, None]
    p = tl.math.exp2(qk)
    alpha = tl.math.exp2(m_i - m_ij)
    l_ij = tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if USE_DESC:
        v = desc_v.load([start_n, 0])
    else:
        kv_rows = start_n + offs_n
        v_ptrs = V + kv_rows[:, None] * stride_vs + offs_d[None, :]
        if MASK_KV:
            v = tl.load(v_ptrs, mask=kv_rows[:, None] < seq_len, other=0.0)
        else:
            v = tl.load(v_ptrs)
    if UPCAST_DOT:
        acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    # Updated last to keep fewer values live across the two dots.
    l_i = l_i * alpha + l_ij
    return acc, l_i, m_ij


@triton.jit
def _kv_loop(acc, l_i, m_i, q, desc_k, desc_v, K, V, stride_ks, stride_vs, seq_len, lo, hi, qk_scale,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASK_KV: tl.constexpr,
             USE_DESC: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PLAIN_LOOP: tl.constexpr,
             UPCAST_DOT: tl.constexpr):
    if PLAIN_LOOP:
        # The interpreter (numpy >= 2.4) cannot take run-time bounds in range(): same body, while loop.
        start_n = lo
        while start_n < hi:
            acc, l_i, m_i = _kv_step(acc, l_i, m_i, q, start_n, desc_k, desc_v, K, V, stride_ks, stride_vs, seq_len,
                                     qk_scale, BLOCK_N, HEAD_DIM, MASK_KV, USE_DESC, UPCAST_DOT)
            start_n += BLOCK_N
    else:
        for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            acc, l_i, m_i = _kv_step(acc, l_i, m_i, q, start_n, desc_k, desc_v, K, V, stride_ks, stride_vs, seq_len,
                                     qk_scale, BLOCK_N, HEAD_DIM, MASK_KV, USE_DESC, UPCAST_DOT)
    return acc, l_i, m_i


@triton.jit
def ulysses_attn_fwd_kernel(
    Q, K, V, out_table,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    heads_local, seq_len, kv_full, seq_local, tiles_per_shard, head_offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_TAIL: tl.constexpr, USE_DESC: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    PLAIN_LOOP: tl.constexpr, UPCAST_DOT: tl.constexpr, TAIL_IN_LOOP: tl.constexpr,
):
    """One program: query rows [m0, m0 + BLOCK_M) of one (batch, local head), m0 = r*seq_local + t*BLOCK_M
    for tile t of rank r's shard: tiles never cross a shard boundary, so each has exactly one owner.

    Q, K, V: (batch, >= seq_len, heads_local, HEAD_DIM), last dim contiguous.
    out_table: int64[num_dest], entry r = address of rank r's (batch, seq_local, heads_total,
    HEAD_DIM) buffer with strides (stride_ob, stride_os, stride_oh, 1) in elements.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // heads_local
    off_h = pid_bh % heads_local
    # Tiles are numbered per owner (the last tile of a shard may be partial): one destination per
    # tile, whatever seq_local is. Rows past the owner's shard are computed and then dropped.
    owner = pid_m // tiles_per_shard
    row0 = (pid_m - owner * tiles_per_shard) * BLOCK_M
    m0 = owner * seq_local + row0
    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    k_base = K + off_b.to(tl.int64) * stride_kb + off_h.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_h.to(tl.int64) * stride_vh
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)

    if USE_DESC:
        # Rows >= seq_len are outside the descriptors and read as zeros (padding never leaks in).
        desc_q = tl.make_tensor_descriptor(q_base, shape=[seq_len, HEAD_DIM], strides=[stride_qs, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        desc_k = tl.make_tensor_descriptor(k_base, shape=[seq_len, HEAD_DIM], strides=[stride_ks, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        desc_v = tl.make_tensor_descriptor(v_base, shape=[seq_len, HEAD_DIM], strides=[stride_vs, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        q = desc_q.load([m0, 0])
    else:
        desc_k = k_base
        desc_v = v_base
        q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=offs_m[:, None] < seq_len,
                    other=0.0)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # kv_full = (seq_len // BLOCK_N) * BLOCK_N, from the host (the interpreter needs a plain scalar bound).
    if TAIL_IN_LOOP:
        # Every KV tile masks (one select per score): the only form Triton 3.6's warp specialization
        # accepts at 4 warps, since any dot outside the specialized loop breaks that pass.
        acc, l_i, m_i = _kv_loop(acc, l_i, m_i, q, desc_k, desc_v, k_base, v_base, stride_ks, stride_vs, seq_len,
                                 0, kv_full + BLOCK_N, qk_scale, BLOCK_N, HEAD_DIM, True, USE_DESC, WARP_SPECIALIZE,
                                 PLAIN_LOOP, UPCAST_DOT)
    else:
        if HAS_TAIL:
            # The ragged last KV tile first, as straight-line code, so the hot loop never masks.
            acc, l_i, m_i = _kv_step(acc, l_i, m_i, q, kv_full, desc_k, desc_v, k_base, v_base, stride_ks,
                                     stride_vs, seq_len, qk_scale, BLOCK_N, HEAD_DIM, True, USE_DESC, UPCAST_DOT)
        acc, l_i, m_i = _kv_loop(acc, l_i, m_i, q, desc_k, desc_v, k_base, v_base, stride_ks, stride_vs, seq_len,
                                 0, kv_full, qk_scale, BLOCK_N, HEAD_DIM, False, USE_DESC, WARP_SPECIALIZE, PLAIN_LOOP,
                                 UPCAST_DOT)

    # Epilogue: the post-attention All-to-All. Row m goes to rank m // seq_local at its final layout.
    o = (acc / l_i[:, None]).to(Q.dtype.element_ty)
    head_col = (off_b.to(tl.int64) * stride_ob + (head_offset + off_h).to(tl.int64) * stride_oh)
    dest = tl.load(out_table + owner).to(tl.pointer_type(Q.dtype.element_ty)) + head_col
    # The owner's valid rows: the last owners' padding rows (S not divisible by P) are never written.
    owner_rows = tl.minimum(seq_local, seq_len - owner * seq_local)
    if USE_DESC:
        # One TMA store through a descriptor spanning exactly the owner's valid rows: a partial
        # last tile's extra rows fall past the end and are not written.
        desc_o = tl.make_tensor_descriptor(dest, shape=[owner_rows, HEAD_DIM], strides=[stride_os, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        desc_o.store([row0, 0], o)
    else:
        rows = row0 + tl.arange(0, BLOCK_M)
        ok = rows < owner_rows
        tl.store(dest + rows[:, None].to(tl.int64) * stride_os + offs_d[None, :], o, mask=ok[:, None])


@triton.jit
def push_heads_kernel(
    src_q, src_k, src_v, dest_table,
    stride_b, stride_s, stride_h,
    dst_stride_t, dst_stride_b, dst_stride_s, dst_stride_h,
    heads, seq_rows, row_offset, heads_per_rank, heads_rem,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Pre-attention All-to-All as remote stores: rows of one (tensor, batch, head) of this rank's
    shard go to the owner of that head, at rows [row_offset, row_offset + seq_rows) of its
    (3, batch, seq_padded, heads_local_max, HEAD_DIM) buffer.

    src_*: (batch, seq_rows, heads, HEAD_DIM) with strides (stride_b, stride_s, stride_h, 1); the
    three tensors share strides. Heads are split unevenly: the first `heads_rem` ranks own
    `heads_per_rank + 1` heads.
    """
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    t = tl.program_id(2)
    b = pid_bh // heads
    h = pid_bh % heads
    big = heads_rem * (heads_per_rank + 1)
    if h < big:
        owner = h // (heads_per_rank + 1)
        local_h = h - owner * (heads_per_rank + 1)
    else:
        owner = heads_rem + (h - big) // heads_per_rank
        local_h = h - big - (owner - heads_rem) * heads_per_rank
    if t == 0:
        src = src_q
    elif t == 1:
        src = src_k
    else:
        src = src_v
    rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows < seq_rows
    x = tl.load(src + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + rows[:, None].to(tl.int64) * stride_s
                + offs_d[None, :], mask=ok[:, None])
    ELEM_BYTES: tl.constexpr = src_q.dtype.element_ty.primitive_bitwidth // 8
    base = tl.load(dest_table + owner)
    off = (t.to(tl.int64) * dst_stride_t + b.to(tl.int64) * dst_stride_b
           + (row_offset + rows).to(tl.int64) * dst_stride_s + local_h.to(tl.int64) * dst_stride_h)
    addr = tl.multiple_of(base + off * ELEM_BYTES, 16)
    tl.store(addr.to(tl.pointer_type(src_q.dtype.element_ty))[:, None] + offs_d[None, :], x, mask=ok[:, None])


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape and pipelining of `ulysses_attn_fwd_kernel`.

    use_desc: TMA tensor-descriptor loads (sm_90+); else plain pointer loads.
    warp_specialize: producer/consumer warp specialization of the main KV loop (sm_90+).
    """

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 2
    warp_specialize: bool = True
    use_desc: bool = True

    def label(self) -> str:
        return (f"bm{self.block_m}_bn{self.block_n}_w{self.num_warps}_s{self.num_stages}"
                f"{'_ws' if self.warp_specialize else ''}{'_desc' if self.use_desc else '_ptr'}")


def default_config(head_dim: int, device: torch.device) -> KernelConfig:
    """The tuned configuration for this device (see benchmarks/results/attention-a2a-h200.md)."""
    if device.type != "cuda":
        # Interpreter: numpy per block; moderate tiles keep the CPU tests fast and exercise tails.
        return KernelConfig(block_m=32, block_n=32, num_warps=4, num_stages=1, warp_specialize=False, use_desc=True)
    major, _ = torch.cuda.get_device_capability(device)
    if major < 9:
        return KernelConfig(block_m=128, block_n=64, num_warps=4, num_stages=3, warp_specialize=False, use_desc=False)
    if head_dim <= 64:
        # 3 stages with warp specialization returned NaN on the H200 (Triton 3.6) at head_dim 128: 2 stages.
        return KernelConfig(block_m=128, block_n=128, num_warps=4, num_stages=2, warp_specialize=True, use_desc=True)
    return KernelConfig(block_m=128, block_n=128, num_warps=4, num_stages=2, warp_specialize=True, use_desc=True)


def launch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_table: torch.Tensor, *,
                     seq_len: int, seq_local: int, head_offset: int, out_strides: tuple[int, int, int],
                     scale: float, config: KernelConfig):
    """Launch the kernel (no validation beyond what the kernel cannot survive; callers validate).

    q, k, v: (batch, >= seq_len, heads_local, head_dim), stride(-1) == 1, 16-byte aligned rows.
    out_table: int64[num_dest] on q's device; every buffer (batch, seq_local, heads_total, head_dim)
    with element strides `out_strides` = (batch, seq, head). Returns the compiled kernel handle.
    """
    batch, _, heads_local, head_dim = q.shape
    if config.use_desc:
        install_descriptor_allocator()
    ws = config.warp_specialize and not interpreting()
    if ws and config.num_warps < 8 and seq_local <= config.block_m:
        # Triton 3.6, H200: the 4-warp warp-specialized kernel left rows 64.. of each tile unwritten (and
        # wrote wrong values at head_dim 128) when an owner's shard is at most one tile (seq 333-336 at
        # P=4, both head dims, bf16 and fp16), while 8 warps and the plain pipelined loop were exact on
        # every shape (benchmarks/diag_attention_configs.py, results/attention-diag-h200.json). Such
        # short shards are rare and cheap: they take the plain loop.
        ws = False
    tiles_per_shard = triton.cdiv(seq_local, config.block_m)
    num_shards = triton.cdiv(seq_len, seq_local)
    grid = (num_shards * tiles_per_shard, batch * heads_local)
    has_tail = seq_len % config.block_n != 0
    return ulysses_attn_fwd_kernel[grid](
        q, k, v, out_table,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out_strides[0], out_strides[1], out_strides[2],
        heads_local, seq_len, (seq_len // config.block_n) * config.block_n, seq_local, tiles_per_shard, head_offset,
        scale * LOG2E,
        HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        HAS_TAIL=has_tail, USE_DESC=config.use_desc, WARP_SPECIALIZE=ws,
        PLAIN_LOOP=interpreting(), UPCAST_DOT=interpreting() and q.dtype == torch.bfloat16,
        TAIL_IN_LOOP=has_tail and ws and config.num_warps < 8,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def launch_push(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dest_table: torch.Tensor, *, row_offset: int,
                world_size: int, dest_strides: tuple[int, int, int, int], block_s: int = 64):
    """Push this rank's (batch, seq_rows, heads, head_dim) q/k/v into the head owners' buffers."""
    batch, seq_rows, heads, head_dim = q.shape
    if seq_rows == 0:
        return None
    grid = (triton.cdiv(seq_rows, block_s), batch * heads, 3)
    return push_heads_kernel[grid](
        q, k, v, dest_table,
        q.stride(0), q.stride(1), q.stride(2),
        dest_strides[0], dest_strides[1], dest_strides[2], dest_strides[3],
        heads, seq_rows, row_offset, heads // world_size, heads % world_size,
        HEAD_DIM=head_dim, BLOCK_S=block_s, num_warps=4,
    )
