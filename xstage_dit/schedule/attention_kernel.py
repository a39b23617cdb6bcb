"""Which kernel writes the post-attention All-to-All for a shape: the fastest one measured that takes it.

    family = shape_family(batch=1, seq_len=4608, heads_local=3, head_dim=128, world_size=8, dtype_name="bfloat16")
    choice = choose_attention_kernel(sweep.timings_ms.get(family), refusals)   # KernelChoice(name, reason, ...)

``refusals`` is every kernel's ``supports(...)`` answer for the problem (None = takes it), from
``ops.attention.kernels.refusals``; the timings come from the machine's kernel sweep
(``calibration.kernel_sweep``). Pure: the same inputs give the same choice wherever it is asked
(eager, compiled, the server's report). The X-Stage design test (``choices.choose_attention_schedule``)
then decides fused vs serial for the chosen kernel (``ops.attention.auto.resolve_attention_decision``
combines both into one ``AttentionDecision``).

World size 1 compares FA4 plain (all heads, no window) and cuDNN's SDPA kernel (torch's cuDNN backend,
"cudnn") with torch's SDPA exactly as diffusers calls it (the ``BASELINE``, "sdpa": torch's default backend
order, FlashAttention-2 on Hopper): ``choose_attention_kernel(timings, {"sdpa": None, "fa4": None, "cudnn":
None}, WORLD1_ORDER, baseline="sdpa")`` names another kernel only where it and the baseline were measured
and it was faster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# World size > 1: the kernels the sweep times through the window, and their order where nothing was measured
# (one owner: ``ops.attention.kernels`` and the sweep read this tuple). fa4-gqa (the owners as GQA query heads
# of one launch) and fa4-gqa-unpacked (owner heads unpacked, slots of whole 128-row tiles only) each won rows
# of the window table, so the sweep times both (benchmarks/results/attention/NOTES.md: "fa4-gqa measured",
# "fa4-gqa-unpacked measured"). FA4 plain-batched stays first where unmeasured.
DEFAULT_ORDER = ("fa4", "fa4-gqa", "fa4-gqa-unpacked", "cudnn", "triton")
# The call that runs when no kernel is chosen: torch SDPA (diffusers' own call at world 1; the serial
# schedule's local attention at world > 1, where its time is the sweep's reference for the ratio).
BASELINE = "sdpa"
WORLD1_ORDER = (BASELINE, "fa4", "cudnn")
# The 8-bit kernels (``ops.attention.fp8_kernels``): candidates only where FP8 attention was asked for
# (``features.fp8.Fp8Config.attention``), after every 16-bit kernel in the order (unmeasured, one of those is
# preferred), in their own sweep family (``shape_family(..., fp8=True)``), so that they are timed in the same run as
# the 16-bit kernels they replace.
FP8_KERNELS = ("cudnn-fp8", "sage")
# What ``Fp8Config.attention`` takes: "off", "auto" (the 8-bit kernels join the sweep) or one kernel by name
# (that kernel wherever it takes the shape: the error benchmark and tests force each).
FP8_ATTENTION = ("off", "auto") + FP8_KERNELS
# World 1: calls with a key-padding mask have their own takers, timed on masked inputs in their own sweep family
# ("-masked", ``ops.attention.masked_sweep``): torch SDPA with the mask, cuDNN's 16-bit kernel with per-sample key
# lengths (``ops.attention.cudnn_padded``) and, compiled with FP8 attention on, cuDNN's FP8 kernel with them
# (``ops.attention.fp8_traced``).
MASKED_KERNELS = (BASELINE, "cudnn-padded", "cudnn-fp8")


# A kernel timed in its compiled form too carries a second entry, "<kernel>+compiled" (world 1's cudnn-fp8, whose
# quantization Inductor folds into the neighbouring kernels: ``ops.attention.fp8_traced``).
COMPILED_SUFFIX = "+compiled"


# And "<kernel>+in-block" beside "sdpa+in-block": each compiled between the elementwise kernels that surround
# attention in a block (``window_path._in_block_cases``), where Inductor folds the FP8 casts into them. Measured on an
# H100 (FLUX, 2026-12-07): the compiled cudnn-fp8 on its own was 3 us a call faster than bf16, but 61 us inside the
# step; the difference of the two in-block timings is what a block saves.
IN_BLOCK_SUFFIX = "+in-block"
IN_BLOCK_BASE = "sdpa"


def as_compiled(timings_ms: dict | None) -> dict | None:
    """The timings a compiled stack chooses by. Where "sdpa", "sdpa+in-block" and "<kernel>+in-block" were timed,
    "<kernel>" stands at sdpa's time plus what it costs over sdpa inside a block; else "<kernel>+compiled" (on its
    own, its casts as passes of their own) stands for "<kernel>"; the other kernels keep their times.
    Example: ``as_compiled({"sdpa": 0.4, "cudnn-fp8": 0.57, "cudnn-fp8+compiled": 0.36})["cudnn-fp8"] == 0.36``;
    ``as_compiled({"sdpa": 0.4, "cudnn-fp8": 0.57, "sdpa+in-block": 0.5, "cudnn-fp8+in-block": 0.44})["cudnn-fp8"]
    == 0.34`` (up to rounding)."""
    if not timings_ms:
        return timings_ms
    derived = (COMPILED_SUFFIX, IN_BLOCK_SUFFIX)
    out = {k: t for k, t in timings_ms.items() if not k.endswith(derived)}
    out.update({k[:-len(COMPILED_SUFFIX)]: t for k, t in timings_ms.items() if k.endswith(COMPILED_SUFFIX)})
    base, base_in_block = timings_ms.get(IN_BLOCK_BASE), timings_ms.get(IN_BLOCK_BASE + IN_BLOCK_SUFFIX)
    if base is not None and base_in_block is not None:
        out.update({k[:-len(IN_BLOCK_SUFFIX)]: base + (t - base_in_block) for k, t in timings_ms.items()
                    if k.endswith(IN_BLOCK_SUFFIX) and k != IN_BLOCK_BASE + IN_BLOCK_SUFFIX})
    return out


def with_fp8(order: tuple[str, ...]) -> tuple[str, ...]:
    """``order`` with the 8-bit kernels appended (the candidates' order where FP8 attention is on)."""
    return tuple(order) + tuple(k for k in FP8_KERNELS if k not in order)


def _seq_bucket(seq_len: int) -> int:
    """Power of two at or above seq_len (1K .. 128K): kernels' relative speed moves slowly with S."""
    return min(1 << 17, max(1 << 10, 1 << max(0, math.ceil(math.log2(max(seq_len, 1))))))


def shape_family(*, batch: int, seq_len: int, heads_local: int, head_dim: int, world_size: int,
                 dtype_name: str, fp8: bool = False, qk_bounded: bool = False, masked: bool = False) -> str:
    """The sweep's key of a shape: dtype, head_dim, batch, bucketed S, heads per launch, P, and whether S
    divides by P (kernels refuse differently with padding rows); ``fp8``: the family whose sweep also times the
    8-bit kernels (suffix "-fp8"); ``qk_bounded`` (with fp8): the layers' q and k come with bounds known in advance
    (``features.qk_bounds``), so world 1's compiled cudnn-fp8 is timed without a pass over q and k (suffix "-qkb");
    ``masked``: world-1 calls with a key-padding mask, torch SDPA masked against the padded kernels (suffix
    "-masked", `MASKED_KERNELS`)."""
    for name, value in (("batch", batch), ("seq_len", seq_len), ("heads_local", heads_local),
                        ("head_dim", head_dim), ("world_size", world_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"expected {name} to be a positive int, got {value!r}")
    pad = "-pad" if seq_len % world_size else ""
    return (f"{dtype_name}-d{head_dim}-b{batch}-s{_seq_bucket(seq_len)}-hr{heads_local}-p{world_size}{pad}"
            f"{'-fp8' if fp8 else ''}{'-qkb' if fp8 and qk_bounded else ''}{'-masked' if masked else ''}")


@dataclass(frozen=True)
class KernelChoice:
    """name: the kernel ("fa4" | "cudnn" | "triton"), or None when every kernel refuses (serial path);
    reason: why, in words (logged, and shown in /v1/calibration); timings_ms / refused: what it was chosen from."""

    name: str | None
    reason: str
    timings_ms: dict = field(default_factory=dict)
    refused: dict = field(default_factory=dict)
    baseline_ms: float | None = None  # torch SDPA at the same shape, where the sweep measured it
    forced: bool = False  # asked for by name (fp8 attention "<kernel>"): runs fused, without the design test

    @property
    def over_baseline(self) -> float | None:
        """t_baseline / t_chosen (> 1: the chosen kernel is faster than torch SDPA), or None unmeasured."""
        t = self.timings_ms.get(self.name) if self.name else None
        return None if t is None or self.baseline_ms is None else self.baseline_ms / t

    def describe(self) -> dict:
        return {"kernel": self.name, "reason": self.reason, "timings_ms": dict(self.timings_ms),
                "refused": dict(self.refused), "baseline_ms": self.baseline_ms, "forced": self.forced}


def _valid_ms(t) -> float | None:
    if t is None:
        return None
    t = float(t)
    return t if math.isfinite(t) and t > 0 else None


def choose_attention_kernel(timings_ms: dict | None, refusals: dict[str, str | None],
                            order: tuple[str, ...] = DEFAULT_ORDER, *, baseline: str | None = None) -> KernelChoice:
    """The fastest measured kernel among those that take the problem; unmeasured: the first in ``order``.

    timings_ms: {kernel: median ms} of the problem's shape family (the sweep), or None; a "sdpa" entry that is
        not among the takers is torch SDPA's time, kept as ``baseline_ms``.
    refusals: {kernel: None (takes it) | why not}. baseline: a taker that keeps the problem unless another was
        measured faster than it at the same shape (world 1: "sdpa", diffusers' own call).
    Example: ``choose_attention_kernel({"sdpa": 9.1, "fa4": 8.4}, {"sdpa": None, "fa4": None}, WORLD1_ORDER,
    baseline="sdpa").name == "fa4"``.
    """
    if baseline is not None and baseline not in refusals:
        raise ValueError(f"expected the baseline {baseline!r} among the kernels offered {sorted(refusals)}")
    timings_ms = timings_ms or {}
    baseline_ms = _valid_ms(timings_ms.get(BASELINE))
    refused = {k: r for k, r in refusals.items() if r}
    takers = [k for k in order if k in refusals and not refusals[k]]
    if not takers:
        why = "; ".join(f"{k}: {r}" for k, r in refused.items()) or "no kernel offered"
        return KernelChoice(None, f"every kernel refuses ({why}): serial path", {}, refused, baseline_ms)
    measured = {k: t for k in takers if (t := _valid_ms(timings_ms.get(k))) is not None}
    unmeasured = [k for k in takers if k not in measured]
    if baseline is not None and baseline not in measured:
        why = (f"only {baseline} takes the shape" if takers == [baseline]
               else f"{baseline} not measured at this shape, so no kernel was shown faster")
        refusal = "; ".join(f"{k}: {r}" for k, r in refused.items())
        return KernelChoice(baseline, why + (f" ({refusal})" if refusal else ""), measured, refused, baseline_ms)
    if measured:
        best = min(measured, key=measured.get)
        others = ", ".join(f"{k} {t:.3f} ms" for k, t in sorted(measured.items(), key=lambda kv: kv[1]) if k != best)
        reason = f"fastest measured on this machine: {best} {measured[best]:.3f} ms" + (f" (vs {others})" if others
                                                                                     else "")
        if unmeasured:
            reason += f"; not measured: {', '.join(unmeasured)}"
        if baseline_ms is not None and best != BASELINE:
            reason += f"; torch SDPA at this shape {baseline_ms:.3f} ms"
        return KernelChoice(best, reason, measured, refused, baseline_ms)
    return KernelChoice(takers[0], f"not measured on this machine: first of {list(order)} that takes the shape",
                        {}, refused, baseline_ms)


@dataclass(frozen=True)
class AttentionDecision:
    """What ``schedule="auto"`` became for one layer shape, with both reasons (logged once, recorded in the
    handle's ``schedule_choices``, shown by ``/v1/calibration``).

    name: the schedule the op runs: "fused:<kernel>" | "serial". reason: why that schedule (the design test, or
    world size 1's comparison with torch SDPA). kernel / kernel_reason / timings_ms / refused / baseline_ms:
    the kernel choice (``KernelChoice``) it rests on.
    """

    name: str
    reason: str
    kernel: str | None
    kernel_reason: str
    timings_ms: dict = field(default_factory=dict)
    refused: dict = field(default_factory=dict)
    baseline_ms: float | None = None

    @classmethod
    def of(cls, name: str, reason: str, kernel: KernelChoice) -> "AttentionDecision":
        return cls(name, reason, kernel.name, kernel.reason, dict(kernel.timings_ms), dict(kernel.refused),
                   kernel.baseline_ms)
