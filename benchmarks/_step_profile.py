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
_FP8 = re.compile(r"e4m3|e5m2|f8f8|fp8|float8", re.I)


def kind_of(name: str) -> str:
    """One of `KINDS` for a kernel (or CPU operator) name. Attention first: cuDNN's and FlashAttention's kernels
    may name GEMM tiles too; an FP8 attention kernel stays "attention" (its share is read against the bf16 row's)."""
    if _ATTENTION.search(name):
        return "attention"
    if _GEMM.search(name):
        return "fp8 gemm" if _FP8.search(name) else "gemm"
    if name.startswith("triton_"):  # Inductor's generated kernels: norms, RoPE, casts, activations, reductions
        return "inductor fused"
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
    own times where ``device`` is not CUDA; torch's text table of the same). Call it warm: a first call's compile
    and autotuning would be counted."""
    averages = profile_once(step)
    if device.type == "cuda":  # kernels only: an operator's device time would count its kernels twice
        events = [(e.key, e.count, e.self_device_time_total) for e in averages
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
        sort_by = "self_cuda_time_total"
    else:
        events = [(e.key, e.count, e.self_cpu_time_total) for e in averages if e.self_cpu_time_total > 0]
        sort_by = "self_cpu_time_total"
    return breakdown(events, top), averages.table(sort_by=sort_by, row_limit=40)
