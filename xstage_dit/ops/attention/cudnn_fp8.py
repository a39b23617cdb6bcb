"""cuDNN's FP8 SDPA forward through ``nvidia-cudnn-frontend``'s graph API (``pygraph.sdpa_fp8``).

Inputs: q, k, v in float8 e4m3, contiguous (B, S, H, D) (cuDNN's BSHD strides), each with a per-tensor descale
(one fp32 on the device); the softmax numerator P is rounded to e4m3 at ``fp8_reference.P_SCALE``. Output: O in
e4m3 at ``scale_o`` (on Hopper cuDNN writes no bf16 O from FP8 inputs: that needs Blackwell and cuDNN >= 9.13, per
the frontend's support checks), (B, Sq, H, D) contiguous; the caller dequantizes it where it belongs
(`fp8_quant.store_rows`). The semantics: ``fp8_reference.cudnn_fp8_emulation``.

With ``kv_lengths`` (int32 (B,) on the device: the count of keys each batch element attends, its first ones) the
graph takes cuDNN's padding mask (``use_padding_mask``, ``seq_len_q`` every query row, ``seq_len_kv`` these): keys at
or past a length are never attended. This is a key-padding mask once the kept keys are moved first
(``fp8_traced.cudnn_fp8_attention``'s ``key_mask``).

One graph per (shapes, scale, device, padded or not), built on first use and cached, its execution plans timed on
the first real
call (`cudnn_fe.CudnnWindowKernel._autotune`, as for the bf16 window kernel). Graphs that ask for Amax_S are
declined by some cuDNN engines and required by others: the graph is built without it first, then with it.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from xstage_dit.ops.attention.cudnn_fe import (CudnnWindowKernel, DeviceHandles, _cudnn, available, backend_version,
                                              bshd_layout, build_plans, full_lengths, padding_lengths, tensor_uid)
from xstage_dit.ops.attention.fp8_quant import DESCALE_K, DESCALE_Q, DESCALE_V, SCALE_O, Fp8QKV
from xstage_dit.ops.attention.fp8_reference import P_SCALE
from xstage_dit.ops.capability import capability_refusal

log = logging.getLogger(__name__)

__all__ = ["CudnnFp8Attention", "PackUids", "shared_attention", "pack_uids", "tensor_pack", "unavailable",
           "pack_counts", "unavailable_cached", "variant_pack"]

HEAD_DIMS = (64, 128)
# the graph's per-call scale tensors -> their row of `Fp8QKV.scales`
_SLOTS = {"descale_q": DESCALE_Q, "descale_k": DESCALE_K, "descale_v": DESCALE_V, "scale_o": SCALE_O}
# cuDNN's FP8 forward: from 9.1, not 9.10.0 (the frontend's own support surface), Hopper or newer.
_MIN_BACKEND = 90100
_BROKEN_BACKENDS = (91000,)


def unavailable(device: torch.device, head_dim: int) -> str | None:
    """Why cuDNN's FP8 forward cannot run on ``device`` at ``head_dim``, or None."""
    refusal = capability_refusal(device, (9, 0), "cuDNN's FP8 attention", " (Hopper)")
    if refusal:
        return refusal
    if head_dim not in HEAD_DIMS:
        return f"cuDNN's FP8 attention is checked at head_dim {HEAD_DIMS}, got {head_dim}"
    reason = available()
    if reason:
        return reason
    version = backend_version()
    if version is None or version < _MIN_BACKEND or version in _BROKEN_BACKENDS:
        return f"cuDNN's FP8 attention needs cuDNN >= 9.1 other than 9.10.0, got {version}"
    return None


@functools.cache
def unavailable_cached(device: str, head_dim: int) -> str | None:
    """`unavailable`, asked once per (device, head_dim): the compiled path checks it on every call."""
    return unavailable(torch.device(device), head_dim)


class CudnnFp8Attention:
    """``run(x: Fp8QKV, attn_scale) -> O`` (e4m3, (B, Sq, H, D)), one cached graph per problem."""

    def __init__(self):
        self._graphs: dict[tuple, list] = {}
        self._handle = DeviceHandles()
        self._consts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # calls bound by uid and address (`variant_pack`) and by tensor (`tensor_pack`, ~270 us of host time a call
        # on an H100's host): what a host-bound step reads first (the e2e bench records the timed runs' counts)
        self.calls_by_pack = {"uid": 0, "tensor": 0}

    def _p_scales(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale_s, descale_s) on ``device``: P's fixed power-of-two scale (P lies in [0, 1])."""
        key = str(device)
        if key not in self._consts:
            self._consts[key] = (torch.full((1,), P_SCALE, dtype=torch.float32, device=device),
                                 torch.full((1,), 1.0 / P_SCALE, dtype=torch.float32, device=device))
        return self._consts[key]

    def _build(self, q_shape, kv_shape, attn_scale: float, device: torch.device, with_amax_s: bool,
               padded: bool) -> list:
        cudnn = _cudnn()
        fp8, flt = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        handle = self._handle(device)
        graph = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=flt, compute_data_type=flt, handle=handle)

        def bshd(name, shape):
            dim, stride = bshd_layout(shape)
            return graph.tensor(name=name, dim=dim, stride=stride, data_type=fp8)

        def scalar(name):
            return graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=flt)

        tq, tk, tv = bshd("q", q_shape), bshd("k", kv_shape), bshd("v", kv_shape)
        names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        scal = {name: scalar(name) for name in names}
        kwargs = dict(q=tq, k=tk, v=tv, attn_scale=attn_scale, use_causal_mask=False, name="sdpa_fp8", **scal)
        lengths = padding_lengths(graph, q_shape[0]) if padded else {}
        if padded:
            kwargs.update(use_padding_mask=True, **lengths)
        try:
            o, _, amax_s, amax_o = graph.sdpa_fp8(generate_stats=False, **kwargs)
        except TypeError:  # frontends before generate_stats
            o, _, amax_s, amax_o = graph.sdpa_fp8(is_inference=True, **kwargs)
        dim, stride = bshd_layout(q_shape)
        o.set_output(True).set_dim(dim).set_stride(stride).set_data_type(fp8)
        outputs = [amax_o] + ([amax_s] if with_amax_s else [])
        for t in outputs:
            t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(flt)
        sizes, workspace = build_plans(graph, cudnn, device)
        amax = torch.empty((len(outputs), 4), dtype=torch.float32, device=device)
        tensors = {"q": tq, "k": tk, "v": tv, "o": o, **scal, **lengths, "amax": outputs}
        # [6]: the operands' uids, once the first call has run (`pack_uids`; False: none); [-1]: the tuned plan
        return [graph, tensors, workspace, handle, sizes, amax, None, None]

    def _graph(self, q_shape, kv_shape, attn_scale: float, device: torch.device, padded: bool) -> list:
        key = (q_shape, kv_shape, attn_scale, str(device), padded)
        hit = self._graphs.get(key)
        if hit is None:
            errors = []
            for with_amax_s in (False, True):
                try:
                    hit = self._build(q_shape, kv_shape, attn_scale, device, with_amax_s, padded)
                    break
                except Exception as exc:  # noqa: BLE001 - the other form is tried; both failing is raised
                    errors.append(f"{'with' if with_amax_s else 'without'} Amax_S: {type(exc).__name__}: {exc}")
            if hit is None:
                raise RuntimeError(f"cuDNN built no FP8 SDPA graph for q {q_shape}, k/v {kv_shape}"
                                   f"{' with per-sample key lengths' if padded else ''}: "
                                   + "; ".join(errors))
            self._graphs[key] = hit
        return hit

    def run(self, x: Fp8QKV, attn_scale: float, out: torch.Tensor | None = None,
            kv_lengths: torch.Tensor | None = None) -> torch.Tensor:
        """x: `Fp8QKV` (q (B, Sq, H, D), k, v (B, Skv, H, D) e4m3 contiguous, their scales) -> O (B, Sq, H, D) e4m3
        at x's SCALE_O (``out`` when given: contiguous, e4m3, q's shape). kv_lengths: int32 (B,) contiguous on q's
        device, each in [1, Skv] (not checked: a host read), or None for every key: batch element b attends its
        first kv_lengths[b] keys only."""
        q = x.q
        if out is None:
            out = torch.empty_like(q)
        elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError(f"expected out of shape {tuple(q.shape)}, e4m3, contiguous, got {tuple(out.shape)} "
                             f"{out.dtype}")
        lengths = None
        if kv_lengths is not None:
            if (kv_lengths.dtype != torch.int32 or kv_lengths.numel() != q.shape[0] or not kv_lengths.is_contiguous()
                    or kv_lengths.device != q.device):
                raise ValueError(f"expected kv_lengths int32 of {q.shape[0]} contiguous on {q.device}, got "
                                 f"{kv_lengths.dtype} {tuple(kv_lengths.shape)} on {kv_lengths.device}")
            kv_lengths = kv_lengths.view(-1, 1, 1, 1)  # as the graph declares it
            lengths = (full_lengths(q.shape[0], q.shape[1], str(q.device)), kv_lengths)
        entry = self._graph(tuple(q.shape), tuple(x.k.shape), float(attn_scale), q.device, lengths is not None)
        graph, t, workspace, handle, sizes, amax, uids, tuned = entry
        # A graph's first call binds its tensors by the graph's own objects (the frontend may lower it, and give
        # uids, only then); later calls by uid and address (`variant_pack`), where every uid is known
        pack = (variant_pack(uids, x, out, kv_lengths) if uids
                else tensor_pack(t, x, out, self._p_scales(q.device), amax, lengths))
        self.calls_by_pack["uid" if uids else "tensor"] += 1
        _cudnn().set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
        if tuned is None and not torch.cuda.is_current_stream_capturing():
            entry[-1] = CudnnWindowKernel._autotune(graph, [pack], workspace, handle, sizes)
        graph.execute(pack, workspace, handle=handle)
        if uids is None:
            entry[6] = pack_uids(t, self._p_scales(q.device), amax, lengths) or False
        return out


def tensor_pack(t: dict, x: Fp8QKV, out: torch.Tensor, p_scales: tuple[torch.Tensor, torch.Tensor],
                amax: torch.Tensor, lengths: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
    """The variant pack keyed by the graph's tensors (`t`: name -> graph tensor, "amax": a list of them), valued by
    torch tensors: what the frontend inspects each call. lengths: a padded graph's (query lengths, key lengths)."""
    scale_s, descale_s = p_scales
    pack = {t["q"]: x.q, t["k"]: x.k, t["v"]: x.v, t["o"]: out, t["descale_q"]: x.slot(DESCALE_Q),
            t["descale_k"]: x.slot(DESCALE_K), t["descale_v"]: x.slot(DESCALE_V), t["descale_s"]: descale_s,
            t["scale_s"]: scale_s, t["scale_o"]: x.slot(SCALE_O)}
    pack.update({tensor: amax[i, :1] for i, tensor in enumerate(t["amax"])})
    if lengths is not None:
        pack.update({t["seq_len_q"]: lengths[0], t["seq_len_kv"]: lengths[1]})
    return pack


def pack_uids(t: dict, p_scales: tuple[torch.Tensor, torch.Tensor], amax: torch.Tensor,
              lengths: tuple[torch.Tensor, torch.Tensor] | None = None) -> PackUids | None:
    """A graph's uids of its operands and the addresses fixed for its life (P's scales, the amax outputs, a padded
    graph's query lengths); None where a tensor has no uid yet (0: the frontend assigns them as it lowers the
    graph)."""
    scale_s, descale_s = p_scales
    fixed = {tensor_uid(t["descale_s"]): descale_s.data_ptr(), tensor_uid(t["scale_s"]): scale_s.data_ptr()}
    fixed.update({tensor_uid(tensor): amax[i, :1].data_ptr() for i, tensor in enumerate(t["amax"])})
    kv_lengths = None
    if lengths is not None:
        fixed[tensor_uid(t["seq_len_q"])] = lengths[0].data_ptr()
        kv_lengths = tensor_uid(t["seq_len_kv"])
    slots = {tensor_uid(t[name]): row for name, row in _SLOTS.items()}
    operands = [tensor_uid(t[name]) for name in ("q", "k", "v", "o")]
    every = [*operands, *slots, *fixed, *([kv_lengths] if lengths is not None else [])]
    # a uid two tensors share collapses in a dict: the count of every uid asked says so
    expected = len(operands) + len(_SLOTS) + 2 + len(t["amax"]) + (2 if lengths is not None else 0)
    if not all(every) or len(set(every)) != expected:
        return None  # an unassigned uid, or two operands sharing one
    return PackUids(*operands, slots, fixed, kv_lengths)


@dataclass(frozen=True)
class PackUids:
    """A graph's uids of q, k, v, o, its four per-call scales (uid -> their row of `Fp8QKV.scales`), its fixed
    uid -> address entries, and a padded graph's per-call key lengths (None: not padded)."""

    q: int
    k: int
    v: int
    o: int
    slots: dict
    fixed: dict
    kv_lengths: int | None = None



def variant_pack(uids: PackUids, x: Fp8QKV, out: torch.Tensor, kv_lengths: torch.Tensor | None = None
                 ) -> dict[int, int]:
    """uid -> device address of every operand of one call. Addresses, not tensors: cudnn-frontend 1.32 reads a
    bare address as the graph declared the tensor, where a tensor is inspected each call (shape, strides, device),
    and the H100 profile at f54244c had 272 us of host time a call in this op, a 100 ms FLUX step waiting 48 ms on
    its host. A scale slot is row i of x's (8, 4) fp32 buffer: the address of ``x.slot(i)``."""
    base, row = x.scales.data_ptr(), x.scales.stride(0) * x.scales.element_size()
    pack = {uids.q: x.q.data_ptr(), uids.k: x.k.data_ptr(), uids.v: x.v.data_ptr(), uids.o: out.data_ptr(),
            **{uid: base + slot * row for uid, slot in uids.slots.items()}}
    pack.update(uids.fixed)
    if (uids.kv_lengths is None) != (kv_lengths is None):
        kind = "a padded graph (key lengths)" if uids.kv_lengths is not None else "a plain graph (no key lengths)"
        raise ValueError(f"expected {kind}'s call, got kv_lengths={'None' if kv_lengths is None else 'a tensor'}")
    if kv_lengths is not None:
        pack[uids.kv_lengths] = kv_lengths.data_ptr()
    return pack


def pack_counts() -> dict[str, int]:
    """`CudnnFp8Attention.calls_by_pack` of the process's shared instance, a copy: {"uid": n, "tensor": m}."""
    return dict(shared_attention().calls_by_pack)


@functools.cache
def shared_attention() -> CudnnFp8Attention:
    """The process's one `CudnnFp8Attention`: the eager kernel (``fp8_kernels``) and the compiled path
    (``fp8_traced``) share its graphs and tuned plans, so both run the same plan per shape."""
    return CudnnFp8Attention()
