"""Where a warm transformer step's GPU time goes, by kind of kernel: one call under torch's profiler.

Issue 41 asks FLUX's FP8 step to reach ~0.92x the peers' (a step near 93 ms on an H100, against 99.9 ms measured
with FP8 attention, fp8/NOTES.md). Whether the rest lies in the FP8 GEMMs (then only a faster GEMM helps), in the
attention, or in Inductor's fused kernels around them (norms, RoPE, the activation casts and their amax reductions)
decides what to build next; a median step time cannot say. This splits one warm call's kernel time into

    fp8 gemm | gemm (not FP8) | attention | inductor fused | other

by kernel name (`kind_of`), and keeps the costliest kernels. On a machine without CUDA the same split runs over
the CPU operators' own times (the CPU test's path), which only shows the bookkeeping works.

    summary, table = step_breakdown(step, device)      # summary: JSON-ready; table: torch's text table
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch

from benchmarks._common import profile_once

__all__ = ["KINDS", "breakdown", "kind_of", "step_breakdown"]

KINDS = ("fp8 gemm", "gemm", "attention", "inductor fused", "other")
_ATTENTION = re.compile(r"sdpa|fmha|flash|attention|attn", re.I)
_GEMM = re.compile(r"gemm|cutlass|nvjet|xmma|matmul|scaled_mm|aten::(mm|addmm|bmm|linear)\b", re.I)
# cuBLAS's nvjet names its operand types by letter: "qq" is two e4m3 operands (measured on an H100, torch 2.11:
# "nvjet_sm90_qqtst_128x128_128x6_1x2_h_bz_ovscale_bias..." for row-wise ``_scaled_mm``; "ovscale": outer-vector scales)
_FP8 = re.compile(r"e4m3|e5m2|f8f8|fp8|float8|nvjet_sm\d+_qq|ovscale", re.I)


def kind_of(name: str) -> str:
    """One of `KINDS` for a kernel (or CPU operator) name. Inductor's kernels first: it names them after the ops
    they fuse, and a cast feeding a GEMM or attention reads "triton_red_fused__scaled_mm_..." (the H100 profile at
    f54244c counted 12 ms of such casts as GEMMs). Then attention: cuDNN's and FlashAttention's kernels may name GEMM
    tiles too; an FP8 attention kernel stays "attention" (its share is read against the bf16 row's)."""
    if name.startswith("triton_"):  # norms, RoPE, casts, activations, reductions
        return "inductor fused"
    if _ATTENTION.search(name):
        return "attention"
    if _GEMM.search(name):
        return "fp8 gemm" if _FP8.search(name) else "gemm"
    return "other"


def breakdown(events: Iterable[tuple[str, int, float]], top: int = 15) -> dict:
    """``events``: (name, calls, microseconds) per kernel -> {"total_ms", "by_kind_ms" (every one of `KINDS`),
    "by_kind_share", "top": [[name (120 characters at most), kind, calls, ms], ...] costliest first}."""
    by_kind = dict.fromkeys(KINDS, 0.0)
    rows = []
    for name, calls, us in events:
        kind = kind_of(name)
        by_kind[kind] += us / 1e3
        rows.append([name[:120], kind, int(calls), round(us / 1e3, 3)])
    total = sum(by_kind.values())
    rows.sort(key=lambda row: -row[3])
    return {"total_ms": round(total, 3), "by_kind_ms": {k: round(v, 3) for k, v in by_kind.items()},
            "by_kind_share": {k: round(v / total, 4) if total else 0.0 for k, v in by_kind.items()},
            "top": rows[:top]}


def step_breakdown(step: Callable[[], object], device: torch.device, top: int = 15) -> tuple[dict, str]:
    """Runs ``step()`` once under torch's profiler -> (`breakdown` of its GPU kernels, or of its CPU operators'
    own times where ``device`` is not CUDA, with ``host_ms``: the CPU operators' own time; torch's text table).
    Call it warm: a first call's compile and autotuning would be counted."""
    averages = profile_once(step)
    # the host's own work (every CPU operator's self time, the profiler's cost included): where it reaches the
    # kernels' sum the step waits on the host (the H100 at f54244c: 172 ms of host for 93 ms of kernels with
    # cudnn-fp8's custom op, a 141 ms step), which a GPU-only account cannot show
    host_ms = sum(e.self_cpu_time_total for e in averages if e.device_type == torch.autograd.DeviceType.CPU) / 1e3
    if device.type == "cuda":  # kernels only: an operator's device time would count its kernels twice
        events = [(e.key, e.count, e.self_device_time_total) for e in averages
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
        sort_by = "self_cuda_time_total"
    else:
        events = [(e.key, e.count, e.self_cpu_time_total) for e in averages if e.self_cpu_time_total > 0]
        sort_by = "self_cpu_time_total"
    summary = breakdown(events, top)
    summary["host_ms"] = round(host_ms, 3)
    return summary, averages.table(sort_by=sort_by, row_limit=40)
