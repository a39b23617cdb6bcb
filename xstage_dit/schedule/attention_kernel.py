"""Which kernel writes the post-attention All-to-All for a shape: the fastest one measured that takes it.

    family = shape_family(batch=1, seq_len=4608, heads_local=3, head_dim=128, world_size=8, dtype_name="bfloat16")
    choice = choose_attention_kernel(sweep.timings_ms.get(family), refusals)   # KernelChoice(name, reason, ...)

``refusals`` is every kernel's ``supports(...)`` answer for the problem (None = takes it), from
``ops.attention.kernels.refusals``; the timings come from the machine's kernel sweep
(``calibration.kernel_sweep``). Pure: the same inputs give the same choice wherever it is asked
(eager, compiled, the server's report). The X-Stage design test (``choices.choose_attention_schedule``)
then decides fused vs serial for the chosen kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DEFAULT_ORDER = ("fa4", "cudnn", "triton")


def _seq_bucket(seq_len: int) -> int:
    """Power of two at or above seq_len (1K .. 128K): kernels' relative speed moves slowly with S."""
    return min(1 << 17, max(1 << 10, 1 << max(0, math.ceil(math.log2(max(seq_len, 1))))))


def shape_family(*, batch: int, seq_len: int, heads_local: int, head_dim: int, world_size: int,
                 dtype_name: str) -> str:
    """The sweep's key of a shape: dtype, head_dim, batch, bucketed S, heads per launch, P, and whether S
    divides by P (kernels refuse differently with padding rows)."""
    for name, value in (("batch", batch), ("seq_len", seq_len), ("heads_local", heads_local),
                        ("head_dim", head_dim), ("world_size", world_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"expected {name} to be a positive int, got {value!r}")
    pad = "-pad" if seq_len % world_size else ""
    return (f"{dtype_name}-d{head_dim}-b{batch}-s{_seq_bucket(seq_len)}-hr{heads_local}-p{world_size}{pad}")


@dataclass(frozen=True)
class KernelChoice:
    """name: the kernel ("fa4" | "cudnn" | "triton"), or None when every kernel refuses (serial path);
    reason: why, in words (logged, and shown in /v1/calibration); timings_ms / refused: what it was chosen from."""

    name: str | None
    reason: str
    timings_ms: dict = field(default_factory=dict)
    refused: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {"kernel": self.name, "reason": self.reason, "timings_ms": dict(self.timings_ms),
                "refused": dict(self.refused)}


def choose_attention_kernel(timings_ms: dict | None, refusals: dict[str, str | None],
                            order: tuple[str, ...] = DEFAULT_ORDER) -> KernelChoice:
    """The fastest measured kernel among those that take the problem; unmeasured: the first in ``order``."""
    refused = {k: r for k, r in refusals.items() if r}
    takers = [k for k in order if k in refusals and not refusals[k]]
    if not takers:
        why = "; ".join(f"{k}: {r}" for k, r in refused.items()) or "no kernel offered"
        return KernelChoice(None, f"every kernel refuses ({why}): serial path", {}, refused)
    measured = {k: float(t) for k, t in (timings_ms or {}).items()
                if k in takers and t is not None and math.isfinite(float(t)) and float(t) > 0}
    if measured:
        best = min(measured, key=measured.get)
        others = ", ".join(f"{k} {t:.3f} ms" for k, t in sorted(measured.items(), key=lambda kv: kv[1]) if k != best)
        reason = f"fastest measured on this machine: {best} {measured[best]:.3f} ms" + (f" (vs {others})" if others
                                                                                     else "")
        unmeasured = [k for k in takers if k not in measured]
        if unmeasured:
            reason += f"; not measured: {', '.join(unmeasured)}"
        return KernelChoice(best, reason, measured, refused)
    return KernelChoice(takers[0], f"not measured on this machine: first of {list(order)} that takes the shape",
                        {}, refused)
