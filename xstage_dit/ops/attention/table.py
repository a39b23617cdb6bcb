"""The fused schedule through a table of buffer pointers: the pre-attention All-to-All as remote stores
into the head owners' symmetric buffers (the Triton push kernel), a device barrier, then the Triton
FlashAttention kernel whose epilogue stores every output tile straight into its owner's output buffer
(DESIGN §2 "piggyback"), a device barrier, and the owner reads its rows. World size 1 runs the same kernel
with a local one-entry table: no rendezvous, no copy. ``fused_attention_virtual_ranks`` runs P ranks in one
process through local tables (tests, benchmarks, the Triton interpreter).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from xstage_dit.comm.buffers import symmetric_buffer
from xstage_dit.comm.distributed import local_buffer_table, world_of
from xstage_dit.ops.attention.checks import check_inputs, check_scale, fused_unavailable
from xstage_dit.ops.attention.partition import head_split, shard_bounds
from xstage_dit.ops.attention.serial import library_pre_all_to_all

if TYPE_CHECKING:
    from xstage_dit.ops.attention.kernel import KernelConfig

__all__ = ["attention_to_buffers", "push_to_owners", "fused_attention", "fused_attention_virtual_ranks"]


def _kernels():
    # Triton is imported on first use of the fused path: the serial path and the reference stay light.
    from xstage_dit.ops.attention import kernel as _attention_kernel

    return _attention_kernel


def _kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """A view the kernel can read: last dim contiguous, 16-byte aligned rows (else a copy)."""
    elem = t.element_size()
    ok = (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
          and all((s * elem) % 16 == 0 for s in t.stride()[:-1]))
    return t if ok else t.contiguous()



def attention_to_buffers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_table: torch.Tensor,
                         out_like: torch.Tensor, *, seq_len: int, seq_local: int, head_offset: int,
                         scale: float | None = None, config: KernelConfig | None = None):
    """The fused kernel on one rank's heads: attention over the whole sequence, output rows stored
    through ``out_table`` into their owners' buffers.

    q, k, v: (batch, >= seq_len, heads_local, head_dim): this rank's heads over the padded sequence.
    out_table: int64[num_dest] on q's device, addresses of buffers laid out like ``out_like``,
        (batch, seq_local, heads_total, head_dim); row m goes to buffer m // seq_local.
    Returns the compiled kernel (``.n_regs``, ``.n_spills``) for resource reports.
    """
    reason = fused_unavailable(q)
    if reason:
        raise ValueError(reason)
    batch, _, heads_local, head_dim = q.shape
    if out_like.dim() != 4 or out_like.shape[0] != batch or out_like.shape[3] != head_dim:
        raise ValueError(f"expected out buffers (batch={batch}, seq_local, heads_total, head_dim={head_dim}), "
                         f"got {tuple(out_like.shape)}")
    if out_like.stride(-1) != 1 or out_like.dtype != q.dtype:
        raise ValueError(f"expected out buffers of dtype {q.dtype} with a contiguous last dim, got "
                         f"{out_like.dtype} with strides {out_like.stride()}")
    if head_offset < 0 or head_offset + heads_local > out_like.shape[2]:
        raise ValueError(f"expected heads [{head_offset}, {head_offset + heads_local}) inside the "
                         f"{out_like.shape[2]} heads of the out buffers")
    if out_table.dtype != torch.int64 or out_table.dim() != 1 or out_table.device != q.device:
        raise ValueError(f"expected out_table int64[num_dest] on {q.device}, got {out_table.dtype} "
                         f"{tuple(out_table.shape)} on {out_table.device}")
    if seq_len > out_table.numel() * seq_local or seq_local > out_like.shape[1]:
        raise ValueError(f"expected seq_len <= num_dest * seq_local and seq_local <= buffer rows, got seq_len="
                         f"{seq_len}, num_dest={out_table.numel()}, seq_local={seq_local}, rows={out_like.shape[1]}")
    if q.shape[1] < seq_len:
        raise ValueError(f"expected q, k, v with at least seq_len={seq_len} rows, got {q.shape[1]}")
    config = config or _kernels().default_config(head_dim, q.device)
    q, k, v = (_kernel_ready(t) for t in (q, k, v))
    return _kernels().launch_attention(q, k, v, out_table, seq_len=seq_len, seq_local=seq_local, head_offset=head_offset,
                                  out_strides=tuple(out_like.stride()[:3]), scale=check_scale(scale, head_dim),
                                  config=config)


def push_to_owners(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, in_table: torch.Tensor, in_like: torch.Tensor, *,
                   rank: int, world_size: int, seq_len: int) -> None:
    """Pre-attention All-to-All as remote stores: this rank's tokens of head h go to the owner of h.

    q, k, v: (batch, seq_local, heads, head_dim), this rank's chunk.
    in_table: int64[world] addresses of every rank's (3, batch, P*ceil(seq_len/P), heads_local_max, head_dim)
        buffer laid out like ``in_like``; rows [rank*chunk, rank*chunk + seq_local) are written.
    """
    chunk = -(-seq_len // world_size)
    q, k, v = (t.contiguous() for t in (q, k, v))
    _kernels().launch_push(q, k, v, in_table, row_offset=rank * chunk, world_size=world_size,
                      dest_strides=tuple(in_like.stride()[:4]))


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, scale: float | None = None,
                    seq_len: int | None = None, config: KernelConfig | None = None) -> torch.Tensor:
    """The fused schedule (see the module docstring). World size 1: the kernel with a local table."""
    rank, world_size = world_of(group)
    seq_len = check_inputs(q, k, v, rank, world_size, seq_len)
    reason = fused_unavailable(q)
    if reason:
        raise ValueError(reason)
    batch, seq_local, heads, head_dim = q.shape
    if world_size == 1:
        out = torch.empty((batch, seq_len, heads, head_dim), dtype=q.dtype, device=q.device)
        attention_to_buffers(q, k, v, local_buffer_table([out]), out, seq_len=seq_len, seq_local=seq_len,
                             head_offset=0, scale=scale, config=config)
        return out
    if not q.is_cuda:
        raise ValueError(f"expected CUDA tensors for the fused schedule at world size {world_size} "
                         f"(symmetric memory), got {q.device}")
    chunk = -(-seq_len // world_size)
    heads_of = head_split(heads, world_size)
    head0, my_heads = heads_of[rank]
    max_heads = heads_of[0][1]
    use_nccl = dist.get_backend(group) == "nccl"
    # Allocated once per shape (first call is collective); reused afterwards, nothing rendezvouses.
    if not use_nccl:
        buf_in = symmetric_buffer("ulysses_attention.in", (3, batch, world_size * chunk, max_heads, head_dim),
                                  q.dtype, q.device, group)
    buf_out = symmetric_buffer("ulysses_attention.out", (batch, chunk, heads, head_dim), q.dtype, q.device, group)
    if use_nccl:
        # One rank per GPU: NCCL's All-to-All (kept for real multi-GPU; the push kernel below is what
        # runs, and is measured, where ranks share a GPU and NCCL refuses them).
        mine = library_pre_all_to_all(q, k, v, group=group, rank=rank, world_size=world_size, seq_len=seq_len)
        # Everyone finished reading the previous call's output before anyone overwrites it.
        buf_out.barrier()
    else:
        push_to_owners(q, k, v, buf_in.ptr_table, buf_in.tensor, rank=rank, world_size=world_size, seq_len=seq_len)
        # Everyone's rows are in my input buffer, and everyone finished reading the previous call's output.
        buf_in.barrier()
        mine = buf_in.tensor[:, :, :, :my_heads]
    attention_to_buffers(mine[0], mine[1], mine[2], buf_out.ptr_table, buf_out.tensor, seq_len=seq_len,
                         seq_local=chunk, head_offset=head0, scale=scale, config=config)
    # Every rank's tiles for my rows have landed (the barrier orders them before my reads).
    buf_out.barrier()
    return buf_out.tensor[:, :seq_local].clone()


def fused_attention_virtual_ranks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, world_size: int,
                                  scale: float | None = None, config: KernelConfig | None = None
                                  ) -> list[torch.Tensor]:
    """The fused schedule for ``world_size`` virtual ranks in one process (tests, benchmarks).

    q, k, v: (batch, seq_len, heads, head_dim), the whole sequence; it is chunked as ranks would
    hold it, every virtual rank pushes its chunk through a local pointer table into the head owners'
    input buffers, then every rank's kernel stores its output tiles into the owners' output buffers.
    Returns the per-rank outputs, (batch, seq_local_r, heads, head_dim) each.
    """
    check_inputs(q, k, v, 0, 1, None)
    batch, seq_len, heads, head_dim = q.shape
    chunk = -(-seq_len // world_size)
    heads_of = head_split(heads, world_size)
    bounds = shard_bounds(seq_len, world_size)
    ins = [torch.zeros((3, batch, world_size * chunk, heads_of[0][1], head_dim), dtype=q.dtype, device=q.device)
           for _ in range(world_size)]
    outs = [torch.full((batch, chunk, heads, head_dim), float("nan"), dtype=q.dtype, device=q.device)
            for _ in range(world_size)]
    in_table, out_table = local_buffer_table(ins), local_buffer_table(outs)
    for r, (start, length) in enumerate(bounds):
        push_to_owners(q[:, start:start + length], k[:, start:start + length], v[:, start:start + length], in_table,
                       ins[0], rank=r, world_size=world_size, seq_len=seq_len)
    for r, (head0, n) in enumerate(heads_of):
        mine = ins[r][:, :, :, :n]
        attention_to_buffers(mine[0], mine[1], mine[2], out_table, outs[0], seq_len=seq_len, seq_local=chunk,
                             head_offset=head0, scale=scale, config=config)
    return [outs[r][:, :length] for r, (_, length) in enumerate(bounds)]
