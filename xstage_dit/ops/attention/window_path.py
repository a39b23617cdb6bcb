"""Ulysses attention whose post-attention All-to-All is the output layout of a stock kernel (DESIGN §2b).

Per call on rank r of P (batch B, sequence S, heads H, head_dim D, L = ceil(S/P)):

1. pre-attention All-to-All: the push kernel stores this rank's tokens of head h into the owner of h's
   (3, B, P*L, Hr_max, D) symmetric input buffer (zeroed once, so padding rows read as 0), then a device
   barrier. The push kernel, not the copy engine: it was the fastest form at every shape of
   `bench_attention_a2a.py --window --pre-a2a` (`benchmarks/results/attention/h200-3106c07-pre-a2a.md`); the
   same slices as `cuMemcpy2DAsync` (`window.pre_a2a_copies`) are one pitched copy per rank, owner, tensor and
   batch element (many small copies), torch ``copy_`` per head slice the same;
2. the chosen kernel (``kernels.py``) attends the rank's heads over the whole sequence with Q viewed as
   (B*P, L, Hr, D) and ``out`` the peer window's view at head offset h0: every row lands in its owner's
   (L, H, D) buffer (window slot b*P + o); padding rows are never written;
3. a device barrier; the owner reads its rows.

The window is built once per shape (``comm.peer_window``); where it cannot be (``PeerWindowUnavailable``)
the call logs once and runs the pointer-table path (``fused_attention``). The kernel is handed in: this
module never measures or loads a choice.
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from xstage_dit.comm.buffers import peer_window, symmetric_buffer
from xstage_dit.comm.distributed import local_buffer_table, world_of
from xstage_dit.comm.peer_window import PeerWindow, PeerWindowUnavailable
from xstage_dit.ops.attention.kernels import OutTarget
from xstage_dit.ops.attention.window import WindowGeometry, head_ranges, shard_rows
from xstage_dit.schedule.attention_kernel import (COMPILED_SUFFIX, DEFAULT_ORDER, FP8_KERNELS, IN_BLOCK_BASE,
                                                 IN_BLOCK_SUFFIX, with_fp8)

log = logging.getLogger(__name__)


def _elem(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def out_target(window: PeerWindow, geom: WindowGeometry, dtype: torch.dtype, head0: int, heads_local: int
               ) -> OutTarget:
    """The window view (B*P, L, Hr, D) at head offset ``head0`` plus the owner table of the same memory."""
    spec_full = geom.out_view(0)
    shape = (spec_full.shape[0], spec_full.shape[1], heads_local, geom.head_dim)
    view = window.view(dtype, shape, spec_full.strides, head0 * geom.head_dim)
    return OutTarget(view=view, table=window.owner_table(0), table_strides=geom.table_strides(), head_offset=head0)


def _push(q, k, v, in_table, in_like, *, rank, world_size, seq_len):
    from xstage_dit.ops.attention.table import push_to_owners

    push_to_owners(q, k, v, in_table, in_like, rank=rank, world_size=world_size, seq_len=seq_len)


class VirtualRun:
    """Result of ``window_attention_virtual_ranks``: per-rank outputs (copies), the open window and its
    geometry (the tests read the padding rows through it; close the window when done)."""

    def __init__(self, outs, window, geom):
        self.outs, self.window, self.geom = outs, window, geom


def window_attention_virtual_ranks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, world_size: int, kernel,
                                   scale: float | None = None, fill: float | None = float("nan"),
                                   all_heads: bool = False) -> VirtualRun:
    """P virtual ranks in one process through a local peer window (tests, benchmarks).

    q, k, v: (B, S, H, D), the whole sequence. Every virtual rank pushes its chunk into the head owners'
    input buffers, then runs ``kernel`` on its heads through the window (``all_heads``: one launch for all H
    heads, head offset 0). ``fill`` poisons the window first (NaN: an unwritten row shows).
    Returns ``VirtualRun`` with ``outs[r]``: (B, rows_r, H, D).
    """
    from xstage_dit.ops.attention import kernel as kern

    batch, seq_len, heads, head_dim = q.shape
    p = world_size
    length = -(-seq_len // p)
    ranges = head_ranges(heads, p)
    hmax = heads if all_heads else ranges[0][1]
    window = PeerWindow.local(p, batch, length * heads * head_dim * _elem(q.dtype), q.device)
    geom = WindowGeometry(p, batch, seq_len, heads, head_dim, window.slot_bytes // _elem(q.dtype))
    if fill is not None:
        window.view(q.dtype, (window.num_ranks * window.num_segments * geom.slot_elems,), (1,)).fill_(fill)
    owners = [(0, heads)] if all_heads else ranges
    ins = [torch.zeros((3, batch, p * length, hmax, head_dim), dtype=q.dtype, device=q.device) for _ in owners]
    rows = shard_rows(seq_len, p)
    if all_heads:
        # One head group holding every head: the gathered sequence is q, k, v themselves.
        for t, src in enumerate((q, k, v)):
            ins[0][t, :, :seq_len] = src
    else:
        in_table = local_buffer_table(ins)
        for r in range(p):
            start = r * length
            if rows[r]:
                sl = slice(start, start + rows[r])
                kern.launch_push(q[:, sl].contiguous(), k[:, sl].contiguous(), v[:, sl].contiguous(), in_table,
                                 row_offset=start, world_size=p, dest_strides=tuple(ins[0].stride()[:4]))
    sc = _scale(scale, head_dim)
    for (h0, hr), buf in zip(owners, ins):
        mine = buf[:, :, :, :hr]
        kernel.run(mine[0], mine[1], mine[2], out_target(window, geom, q.dtype, h0, hr), geom, sc)
    outs = [torch.stack([window.slot_tensor(b, o, q.dtype, (length, heads, head_dim))[:rows[o]]
                         for b in range(batch)]).clone() for o in range(p)]
    return VirtualRun(outs, window, geom)


@functools.cache
def _log_fallback(reason: str) -> None:
    log.warning("peer window unavailable (%s): the fused path stores through the pointer table", reason)


def fused_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, kernel,
                           scale: float | None = None, seq_len: int | None = None) -> torch.Tensor:
    """Ulysses attention over ``group`` with ``kernel`` writing the post-A2A through the peer window.

    q, k, v: (B, seq_local, H, D), this rank's chunk -> (B, seq_local, H, D). World size >= 2 (world size 1
    needs no window: the kernel writes a plain tensor). Falls back, logged once, to ``fused_attention``
    (pointer table) where the window cannot be built.
    """
    from xstage_dit.ops.attention.checks import check_inputs
    from xstage_dit.ops.attention.table import fused_attention

    rank, p = world_of(group)
    seq_len = check_inputs(q, k, v, rank, p, seq_len)
    batch, seq_local, heads, head_dim = q.shape
    length = -(-seq_len // p)
    h0, hr = head_ranges(heads, p)[rank]
    hmax = head_ranges(heads, p)[0][1]
    try:
        window, outs = peer_window("ulysses_window.out", (length, heads, head_dim), q.dtype, q.device, group,
                                   segments=batch)
    except PeerWindowUnavailable as exc:
        _log_fallback(str(exc))
        return fused_attention(q, k, v, group=group, scale=scale, seq_len=seq_len)
    geom = WindowGeometry(p, batch, seq_len, heads, head_dim, window.slot_bytes // _elem(q.dtype))
    reason = kernel.supports(geom, q.dtype, q.device, True)
    if reason:
        raise ValueError(f"kernel {kernel.name} refuses this problem: {reason}")
    buf_in = symmetric_buffer("ulysses_window.in", (3, batch, p * length, hmax, head_dim), q.dtype, q.device, group)
    if not buf_in.zeroed:
        # Padding rows are never pushed: zero once so a kernel reading whole pages reads zeros, not NaN.
        buf_in.tensor.zero_()
        # No peer may push into my buffer before my zeros are in.
        buf_in.barrier()
        buf_in.zeroed = True  # on the buffer itself: a freed buffer's successor starts unzeroed
    target = _target_for(window, geom, q.dtype, h0, hr)
    _push(q, k, v, buf_in.ptr_table, buf_in.tensor, rank=rank, world_size=p, seq_len=seq_len)
    # Everyone's rows are in my input buffer, and everyone finished reading the previous call's output.
    buf_in.barrier()
    mine = buf_in.tensor[:, :, :, :hr]
    kernel.run(mine[0], mine[1], mine[2], target, geom, _scale(scale, head_dim))
    # Every rank's tiles for my rows have landed (the barrier orders them before my reads).
    outs[0].barrier()
    return torch.stack([o.tensor[:seq_local] for o in outs])


def plain_kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel, *,
                           scale: float | None = None) -> torch.Tensor:
    """World size 1: ``kernel`` on all heads through a one-slot window view of a plain output.

    q, k, v: (B, S, H, D) -> (B, S, H, D). The window of one rank is the output itself (slot stride = one
    batch element), so the kernel runs exactly as it does for P ranks; no peer memory, no rendezvous.
    """
    batch, seq_len, heads, head_dim = q.shape
    geom = WindowGeometry(1, batch, seq_len, heads, head_dim, seq_len * heads * head_dim)
    reason = kernel.supports(geom, q.dtype, q.device, True)
    if reason:
        raise ValueError(f"kernel {kernel.name} refuses this problem: {reason}")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    table = local_buffer_table([out])
    target = OutTarget(out, table, (seq_len * heads * head_dim, heads * head_dim, head_dim), 0)
    kernel.run(q, k, v, target, geom, _scale(scale, head_dim))
    return out


_TARGETS: dict[tuple, OutTarget] = {}


def _target_for(window, geom, dtype, h0, hr) -> OutTarget:
    key = (id(window), geom, dtype, h0, hr)
    target = _TARGETS.get(key)
    if target is None or window.closed:
        target = _TARGETS[key] = out_target(window, geom, dtype, h0, hr)
    return target


def fa4_plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None
                        ) -> torch.Tensor:
    """World size 1 with FA4 chosen: FA4 on all heads of (B, S, H, D) q, k, v -> a fresh (B, S, H, D) output.

    No window, no owner table, no copy: the one allocation is FA4's output, as torch SDPA makes its own.
    Raises ValueError naming the reason where FA4 refuses the problem (device, dtype, head_dim, not installed).
    """
    from xstage_dit.ops.attention import fa4

    batch, seq_len, heads, head_dim = q.shape
    reason = fa4.supports(WindowGeometry(1, batch, seq_len, heads, head_dim, seq_len * heads * head_dim), q.dtype,
                          q.device, True)
    if reason:
        raise ValueError(f"kernel fa4 refuses this problem: {reason}")
    return _fa4_plain().run_plain(q, k, v, _scale(scale, head_dim))


def cudnn_plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None
                          ) -> torch.Tensor:
    """World size 1 with "cudnn" chosen: cuDNN's SDPA kernel through torch's cuDNN backend on (B, S, H, D) q, k,
    v -> a fresh contiguous (B, S, H, D) output (torch lays cuDNN's output out like q: the transpose back is free).

    Torch's backend rather than cudnn-frontend's graph here: the same cuDNN kernel, without a Python graph per
    call and without the extra package, where no window has to be written. Raises ValueError naming the reason
    where cuDNN refuses the problem.
    """
    batch, seq_len, heads, head_dim = q.shape
    reason = cudnn_sdpa_supports(q.dtype, head_dim, q.device)
    if reason:
        raise ValueError(f"kernel cudnn refuses this problem: {reason}")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                               scale=_scale(scale, head_dim))
    return out.transpose(1, 2).contiguous()


def cudnn_sdpa_supports(dtype: torch.dtype, head_dim: int, device: torch.device) -> str | None:
    """Why torch's cuDNN SDPA backend cannot take the problem, or None."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"cuDNN SDPA needs a CUDA device, got {device}"
    if not torch.backends.cudnn.is_available():
        return "torch was built without cuDNN"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"cuDNN SDPA takes float16/bfloat16, got {dtype}"
    if head_dim % 8 or head_dim > 128:
        return f"cuDNN SDPA takes head_dim a multiple of 8 up to 128, got {head_dim}"
    return None


@functools.cache
def _fa4_plain():
    from xstage_dit.ops.attention.fa4 import FA4WindowKernel

    return FA4WindowKernel()


def _problem(prob: dict) -> tuple:
    b, s, h, d, p = (int(prob[k]) for k in ("batch", "seq_len", "heads", "head_dim", "world_size"))
    return b, s, h, d, p, prob["dtype"], torch.device(prob["device"]), bool(prob.get("fp8", False))


def _qk_bounded(prob: dict) -> bool:
    return bool(prob.get("fp8", False) and prob.get("qk_bounded", False))


def problem_family(*, batch: int, seq_len: int, heads: int, head_dim: int, world_size: int,
                   dtype: torch.dtype, fp8: bool = False, qk_bounded: bool = False, masked: bool = False) -> str:
    """The sweep's family of one rank's problem (``schedule.attention_kernel.shape_family`` at the heads of the
    last rank, the launch ``sweep_cases`` times): the one rule the sweep and the chooser share. ``fp8``: the family
    that also times the 8-bit kernels; ``qk_bounded``: of layers whose q and k bounds are known in advance;
    ``masked``: of world-1 calls with a key-padding mask (`masked_cases`)."""
    from xstage_dit.schedule.attention_kernel import shape_family

    heads_local = heads if world_size == 1 else head_ranges(heads, world_size)[-1][1]
    return shape_family(batch=batch, seq_len=seq_len, heads_local=heads_local, head_dim=head_dim,
                        world_size=world_size, dtype_name=str(dtype).removeprefix("torch."), fp8=fp8,
                        qk_bounded=qk_bounded, masked=masked)


def problem_refusals(*, batch: int, seq_len: int, heads: int, head_dim: int, world_size: int, dtype: torch.dtype,
                     device: torch.device, fp8: bool = False) -> dict[str, str | None]:
    """Every candidate's answer for q of (batch, seq_len / world_size, heads, head_dim) per rank: None (takes it)
    or why not. World size 1: torch SDPA ("sdpa", always), FA4 plain ("fa4") and torch's cuDNN SDPA backend
    ("cudnn"); else the window kernels. ``fp8``: the 8-bit kernels too (``FP8_KERNELS``, at every world size)."""
    from xstage_dit.ops.attention.kernels import make_kernel, refusals

    device = torch.device(device)
    length = -(-seq_len // world_size)
    geom = WindowGeometry(world_size, batch, seq_len, heads, head_dim, length * heads * head_dim)
    eight_bit = refusals(geom, dtype, device, True, FP8_KERNELS) if fp8 else {}
    if world_size == 1:
        return {"sdpa": None, "fa4": make_kernel("fa4").supports(geom, dtype, device, True),
                "cudnn": cudnn_sdpa_supports(dtype, head_dim, device), **eight_bit}
    return {**refusals(geom, dtype, device, True, DEFAULT_ORDER), **eight_bit}


def _world1_cases(b, s, h, d, dtype, device, kernel_names, qk_bounded: bool = False) -> dict:
    """Torch SDPA exactly as diffusers calls it ((B, H, S, D) views, default backends) vs FA4 plain, torch's
    cuDNN backend and the 8-bit kernels named in ``kernel_names`` (their plain world-1 path), at the real
    (B, S, H, D) shape."""
    import torch.nn.functional as F

    q, k, v = (torch.randn((b, s, h, d), dtype=dtype, device=device) for _ in range(3))
    scale = d ** -0.5

    def sdpa(q=q, k=k, v=v):
        F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)

    fns = {"sdpa": sdpa}
    geom = WindowGeometry(1, b, s, h, d, s * h * d)
    if "fa4" in kernel_names:
        from xstage_dit.ops.attention.kernels import make_kernel

        fa4 = make_kernel("fa4")
        if fa4.supports(geom, dtype, device, True) is None:
            def plain(q=q, k=k, v=v, impl=fa4._impl):
                impl.run_plain(q, k, v, scale)

            fns["fa4"] = plain
    if "cudnn" in kernel_names and cudnn_sdpa_supports(dtype, d, device) is None:
        fns["cudnn"] = lambda q=q, k=k, v=v: cudnn_plain_attention(q, k, v, scale=scale)
    from xstage_dit.ops.attention.kernels import make_kernel

    for name in (n for n in kernel_names if n in FP8_KERNELS):
        kernel = make_kernel(name)
        if kernel.supports(geom, dtype, device, True) is None:
            fns[name] = lambda q=q, k=k, v=v, kernel=kernel: plain_kernel_attention(q, k, v, kernel, scale=scale)
            if name == "cudnn-fp8":
                fns[name + COMPILED_SUFFIX] = _compiled_cudnn_fp8(q, k, v, scale, qk_bounded)
                fns.update(_in_block_cases(q, k, v, scale, qk_bounded))
    return fns


def _compiled_cudnn_fp8(q, k, v, scale, qk_bounded: bool = False):
    """cudnn-fp8 as a compiled stack runs it at world 1 (``fp8_traced``), compiled on its own: its casts as separate
    kernels, where a compiled block fuses them into its neighbours (an upper bound of its cost there). qk_bounded:
    q's and k's bounds handed in, as layers with ``features.qk_bounds`` run it (no pass over q and k first)."""
    from xstage_dit.ops.attention.fp8_traced import cudnn_fp8_attention

    bounds = (q.abs().amax().float(), k.abs().amax().float()) if qk_bounded else None
    compiled = torch.compile(functools.partial(cudnn_fp8_attention, scale=scale), fullgraph=True, dynamic=False)
    return lambda: compiled(q, k, v, amax_bounds=bounds)


# The elementwise work around attention in a block, in the sweep's in-block timings: q and k come out of one kernel
# (the q/k norm and RoPE's place, where Inductor folds the FP8 cast of q and k), v as a GEMM leaves it (nothing to
# fold its amax and cast into), and the output goes into one (the next linear layer's input, where the
# dequantization folds).
_PRODUCER_GAIN = 1.25


def _in_block_cases(q, k, v, scale, qk_bounded: bool = False) -> dict:
    """{"cudnn-fp8+in-block", "sdpa+in-block"}: cudnn-fp8 as a compiled stack runs it (``fp8_traced``) and torch SDPA
    as diffusers calls it, each compiled between the elementwise kernels that surround attention in a block
    (``_PRODUCER_GAIN``). Their difference is what cudnn-fp8 saves there (``attention_kernel.as_compiled``); on its
    own it also pays its casts as passes of their own. qk_bounded: q's and k's bounds handed in."""
    import torch.nn.functional as F

    from xstage_dit.ops.attention.fp8_traced import cudnn_fp8_attention

    gain = _PRODUCER_GAIN
    bounds = ((q.abs().amax().float() * gain, k.abs().amax().float() * gain) if qk_bounded else None)

    def fp8_block(q, k, v):
        return cudnn_fp8_attention(q * gain, k * gain, v, scale=scale, amax_bounds=bounds) * gain

    def sdpa_block(q, k, v):
        out = F.scaled_dot_product_attention((q * gain).transpose(1, 2), (k * gain).transpose(1, 2), v.transpose(1, 2),
                                             scale=scale)
        return out.transpose(1, 2) * gain

    compiled = {name: torch.compile(fn, fullgraph=True, dynamic=False)
                for name, fn in (("cudnn-fp8", fp8_block), (IN_BLOCK_BASE, sdpa_block))}
    return {name + IN_BLOCK_SUFFIX: (lambda fn=fn: fn(q, k, v)) for name, fn in compiled.items()}


def sweep_cases(problems, kernel_names=DEFAULT_ORDER) -> dict:
    """Timing closures for the kernel sweep: {family: {kernel: fn}} (``problem_family`` names the family).

    World size > 1: each kernel that takes the problem running one rank's launch (the last rank: its head
    offset is not 0) through a local peer window, and "sdpa": the serial schedule's local attention
    (``serial.sdpa``) at the same heads, the reference of the kernel's speed. World size 1: "sdpa" (torch SDPA
    as diffusers calls it), "fa4" (FA4 plain on all heads) and "cudnn" (torch's cuDNN backend) at the real shape.
    A problem with ``fp8`` true also times the 8-bit kernels (``FP8_KERNELS``), in its own family.

    problems: dicts with batch, seq_len, heads, head_dim, world_size, dtype (a torch dtype), device and optionally
    fp8, qk_bounded and masked (world 1: `masked_sweep.masked_cases` instead, its own family).
    The closures hold their windows and tensors; dropping the dict releases them.
    """
    from xstage_dit.ops.attention.kernels import make_kernel
    from xstage_dit.ops.attention.serial import sdpa as serial_sdpa

    cases = {}
    for prob in problems:
        b, s, h, d, p, dtype, device, fp8 = _problem(prob)
        bounded = _qk_bounded(prob)
        masked = bool(p == 1 and prob.get("masked", False))
        family = problem_family(batch=b, seq_len=s, heads=h, head_dim=d, world_size=p, dtype=dtype, fp8=fp8,
                                qk_bounded=bounded, masked=masked)
        if family in cases:
            continue
        names = with_fp8(kernel_names) if fp8 else tuple(kernel_names)
        if masked:
            from xstage_dit.ops.attention.masked_sweep import masked_cases

            cases[family] = masked_cases(b, s, h, d, dtype, device, fp8=fp8, qk_bounded=bounded)
            continue
        if p == 1:
            cases[family] = _world1_cases(b, s, h, d, dtype, device, names, bounded)
            continue
        h0, hr = head_ranges(h, p)[-1]
        length = -(-s // p)
        window = PeerWindow.local(p, b, length * h * d * _elem(dtype), device)
        geom = WindowGeometry(p, b, s, h, d, window.slot_bytes // _elem(dtype))
        buf = torch.zeros((3, b, p * length, hr, d), dtype=dtype, device=device)
        buf[:, :, :s].normal_()
        target = out_target(window, geom, dtype, h0, hr)

        def local(buf=buf, scale=d ** -0.5):
            serial_sdpa(buf[0, :, :s], buf[1, :, :s], buf[2, :, :s], scale)

        fns = {"sdpa": local}
        for name in names:
            kernel = make_kernel(name)
            if kernel.supports(geom, dtype, device, True) is None:
                # The default argument keeps the window alive as long as the closure.
                def timed(kernel=kernel, window=window, target=target, geom=geom, buf=buf, scale=d ** -0.5):
                    kernel.run(buf[0], buf[1], buf[2], target, geom, scale)

                fns[name] = timed
        cases[family] = fns
    return cases
