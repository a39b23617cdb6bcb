"""cuDNN's 16-bit SDPA forward with per-sample key lengths (its padding mask), for world-1 calls with a key-padding mask.

    out = cudnn_padded_attention(q, k, v, key_mask, scale=None)   # q (B, Sq, H, D), k, v (B, Skv, H, D) bf16/fp16

torch's SDPA takes a key-padding mask as a dense boolean operand, and its cuDNN kernel slows down by about half with
it (NucleusMoE on an H100: ~375 against ~680 TFLOP/s unmasked, fp8/NOTES.md). Here each batch element's kept keys
are moved first (``key_padding.kept_keys_first``: any key-padding mask, no host read) and cuDNN's own padding mask
attends only the first ``kv_lengths[b]`` keys: the same attention, in the kernel's padded form. A custom op
(``xstage_dit::cudnn_padded_sdpa``) runs the kernel alone, so that under ``torch.compile`` the gather folds into the
kernels that produce k and v. Chosen per shape by the masked sweep family (`masked_sweep`), never unmeasured.

One graph per (shapes, dtype, scale, device), built on first use and cached, its execution plans timed on the first
call (`cudnn_fe.CudnnWindowKernel._autotune`); later calls bind their operands by uid and address (the tensor-keyed
form costs ~270 us of host time a call: ``cudnn_fp8.variant_pack``).
"""

from __future__ import annotations

import functools

import torch

from xstage_dit.ops.attention.cudnn_fe import (DTYPES, HEAD_DIMS, CudnnWindowKernel, DeviceHandles, _cudnn, available,
                                              bshd_layout, build_plans, full_lengths, padding_lengths, tensor_uid)
from xstage_dit.ops.attention.fp8_quant import check_qkv_shapes
from xstage_dit.ops.attention.key_padding import kept_keys_first
from xstage_dit.ops.capability import capability_refusal
from xstage_dit.ops.registry import NAMESPACE

__all__ = ["CudnnPaddedAttention", "cudnn_padded_attention", "shared_padded", "unavailable"]

_OPERANDS = ("q", "k", "v", "o", "seq_len_kv")


def unavailable(device: torch.device, head_dim: int, dtype: torch.dtype) -> str | None:
    """Why cuDNN's padded 16-bit SDPA cannot run on ``device`` at ``head_dim`` and ``dtype``, or None."""
    refusal = capability_refusal(torch.device(device), (8, 0), "cuDNN's padded SDPA", " (Ampere)")
    if refusal:
        return refusal
    if dtype not in DTYPES:
        return f"cuDNN's padded SDPA takes float16/bfloat16, got {dtype}"
    if head_dim not in HEAD_DIMS:
        return f"cuDNN's padded SDPA is checked at head_dim {HEAD_DIMS}, got {head_dim}"
    return available()


class CudnnPaddedAttention:
    """``run(q, k, v, kv_lengths, scale) -> out``: one cached graph per problem (module docstring)."""

    def __init__(self):
        self._graphs: dict[tuple, list] = {}
        self._handle = DeviceHandles()

    def _build(self, q_shape, kv_shape, dtype: torch.dtype, scale: float, device: torch.device) -> list:
        cudnn = _cudnn()
        io = cudnn.data_type.BFLOAT16 if dtype == torch.bfloat16 else cudnn.data_type.HALF
        handle = self._handle(device)
        graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=handle)

        def bshd(name, shape):
            dim, stride = bshd_layout(shape)
            return graph.tensor(name=name, dim=dim, stride=stride, data_type=io)

        t = {"q": bshd("q", q_shape), "k": bshd("k", kv_shape), "v": bshd("v", kv_shape),
             **padding_lengths(graph, q_shape[0])}
        kwargs = dict(name="sdpa", q=t["q"], k=t["k"], v=t["v"], attn_scale=scale, use_padding_mask=True,
                      seq_len_q=t["seq_len_q"], seq_len_kv=t["seq_len_kv"])
        try:
            o, _ = graph.sdpa(generate_stats=False, **kwargs)
        except TypeError:  # frontends before generate_stats
            o, _ = graph.sdpa(is_inference=True, **kwargs)
        dim, stride = bshd_layout(q_shape)
        o.set_output(True).set_dim(dim).set_stride(stride).set_data_type(io)
        t["o"] = o
        sizes, workspace = build_plans(graph, cudnn, device)
        # [4]: {uid: name} of the operands once the first call has lowered the graph (False: none); [-1]: the plan
        return [graph, t, workspace, handle, None, sizes, None]

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lengths: torch.Tensor, scale: float
            ) -> torch.Tensor:
        """q (B, Sq, H, D), k, v (B, Skv, H, D) contiguous, one 16-bit dtype, on one CUDA device; kv_lengths int32
        (B,) on it, each in [1, Skv] (not checked: a host read) -> (B, Sq, H, D) contiguous: batch element b attends
        its first kv_lengths[b] keys."""
        check_qkv_shapes(q, k, v)
        if not all(t.is_contiguous() for t in (q, k, v)):
            raise ValueError("expected contiguous q, k, v (cuDNN's BSHD strides)")
        if kv_lengths.dtype != torch.int32 or kv_lengths.numel() != q.shape[0] or kv_lengths.device != q.device:
            raise ValueError(f"expected kv_lengths int32 of {q.shape[0]} on {q.device}, got {kv_lengths.dtype} "
                             f"{tuple(kv_lengths.shape)} on {kv_lengths.device}")
        key = (tuple(q.shape), tuple(k.shape), q.dtype, float(scale), str(q.device))
        if key not in self._graphs:
            self._graphs[key] = self._build(tuple(q.shape), tuple(k.shape), q.dtype, float(scale), q.device)
        entry = self._graphs[key]
        graph, t, workspace, handle, uids, sizes, tuned = entry
        out = torch.empty_like(q)
        values = {"q": q, "k": k, "v": v, "o": out, "seq_len_kv": kv_lengths.contiguous().view(-1, 1, 1, 1),
                  "seq_len_q": full_lengths(q.shape[0], q.shape[1], str(q.device))}
        pack = ({uid: values[name].data_ptr() for uid, name in uids.items()} if uids
                else {t[name]: value for name, value in values.items()})
        _cudnn().set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
        if tuned is None and not torch.cuda.is_current_stream_capturing():
            entry[-1] = CudnnWindowKernel._autotune(graph, [pack], workspace, handle, sizes)
        graph.execute(pack, workspace, handle=handle)
        if uids is None:
            entry[4] = _operand_uids(t) or False
        return out


def _operand_uids(t: dict) -> dict[int, str] | None:
    """{uid: operand name} of a lowered graph's tensors, or None where one has no uid yet or two share one. The
    query lengths' tensor is bound by address too (a fixed tensor per shape, `cudnn_fe.full_lengths`)."""
    names = (*_OPERANDS, "seq_len_q")
    uids = {tensor_uid(t[name]): name for name in names}
    return uids if all(uids) and len(uids) == len(names) else None


@functools.cache
def shared_padded() -> CudnnPaddedAttention:
    """The process's one `CudnnPaddedAttention` (its graphs and tuned plans shared by every caller)."""
    return CudnnPaddedAttention()


@torch.library.custom_op(f"{NAMESPACE}::cudnn_padded_sdpa", mutates_args=())
def _cudnn_padded_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lengths: torch.Tensor,
                       scale: float) -> torch.Tensor:
    reason = unavailable(q.device, q.shape[-1], q.dtype)
    if reason:
        raise ValueError(f"cudnn-padded refuses q of {tuple(q.shape)} on {q.device}: {reason}")
    return shared_padded().run(q.contiguous(), k.contiguous(), v.contiguous(), kv_lengths, scale)


@_cudnn_padded_sdpa.register_fake
def _(q, k, v, kv_lengths, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def cudnn_padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor,
                           scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v over the keys ``key_mask`` keeps, through cuDNN's padded kernel.

    q: (B, Sq, H, D), k, v: (B, Skv, H, D), bf16 or fp16, on one CUDA device; key_mask: bool (B | 1, Skv) or
    (B | 1, 1, 1, Skv), True for a key attended, at least one a batch element -> (B, Sq, H, D) in q's dtype,
    contiguous. scale: default 1/sqrt(D)."""
    check_qkv_shapes(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    k, v, kv_lengths = kept_keys_first(k, v, key_mask)
    return torch.ops.xstage_dit.cudnn_padded_sdpa(q, k, v, kv_lengths, scale)
