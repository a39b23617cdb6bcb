"""The MoE schedule: which path an expert-parallel layer runs and, on the fused path, the lead.

One chooser, ``choose_moe_schedule``, made of two steps that are also public:

- ``choose_moe_path``: "fused" | "serial" | "reference" from the device and the layer shape (a user's
  explicit path is honoured; "auto" takes the fused kernel only where it was measured faster);
- ``choose_moe_lead``: wave-by-wave or interleaved combine and the lead ``D`` from the X-Stage design
  test (DESIGN §2, "reshape").

Inputs are the calibrated ``XStageParams`` (or None), the ``DeviceFacts`` of the device the layer runs on
and the shape (dtype width from the tensors). ``MoEScheduler`` makes each decision once per layer shape,
logs it once with its reason and is shared by the EP layers of one model (``patches.expert_parallel``).

    s = choose_moe_schedule(xparams, DeviceFacts.from_device(x.device), requested="auto", hidden=2048,
                            intermediate=1344, rows_per_expert=256, num_experts_per_rank=128, dtype_bytes=2,
                            block_m=128, block_n1=128, block_n2=128)
    s.path, s.lead, s.reason   # ("fused", 2, "...") on a GPU, with a calibration
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from xstage_dit.schedule.choices import ScheduleChoice
from xstage_dit.schedule.facts import DeviceFacts

log = logging.getLogger(__name__)

__all__ = ["EP_PATHS", "FUSED_AUTO_MIN_LOCAL_EXPERTS", "MOE_ROUTINGS", "MoESchedule", "MoEScheduler", "check_moe_path",
           "choose_moe_path", "choose_moe_lead", "choose_moe_schedule"]

EP_PATHS = ("auto", "fused", "serial", "reference")

# `auto` runs the fused kernel only where it was measured faster than grouped matmul: with many local experts
# (NucleusMoE's 128 to 16 per rank), not with few large ones (HiDream's 4/2/1 per rank), which take the serial
# path. The threshold sits between the two; the timings and the multi-process agreement with diffusers' layer:
# benchmarks/results/moe/NOTES.md ("TMA descriptors", "Two processes sharing one GPU").
FUSED_AUTO_MIN_LOCAL_EXPERTS = 16

# Per-SM bf16 tensor-core rate our expert kernel is assumed to sustain when timing a tile from its FLOPs: a
# Triton tile's rate below cuBLAS's bmm, spread over the SMs (the measured rates: DESIGN §4 and
# benchmarks/results/moe/NOTES.md, "Floors").
MOE_TILE_FLOPS_PER_SM = 4.545e12
# Share of the L2 cache (``DeviceFacts.l2_bytes``) the SwiGLU output of in-flight waves may take before the
# lead costs locality (the ceiling on the lead).
L2_SHARE_FOR_LEAD = 0.5


def _check_ints(**values: Any) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"expected {name} to be an int >= 1, got {v!r}")


def check_moe_path(path: str) -> str:
    """``path`` if it is one of ``EP_PATHS``, else ValueError naming it."""
    if path not in EP_PATHS:
        raise ValueError(f"expected path in {EP_PATHS}, got {path!r}")
    return path


def choose_moe_path(facts: DeviceFacts, *, num_experts_per_rank: int, requested: str = "auto") -> ScheduleChoice:
    """The EP layer's path: ScheduleChoice(name "fused" | "serial" | "reference", reason).

    requested: "auto" (fused on CUDA with >= ``FUSED_AUTO_MIN_LOCAL_EXPERTS`` local experts, serial on
    CUDA below, reference off CUDA) or an explicit path, honoured ("fused" off CUDA: RuntimeError).
    """
    check_moe_path(requested)
    _check_ints(num_experts_per_rank=num_experts_per_rank)
    if requested != "auto":
        if requested == "fused" and not facts.is_cuda:
            raise RuntimeError(f"path='fused' needs CUDA tensors, got {facts.name}")
        return ScheduleChoice(requested, f"path {requested!r} requested", {})
    if not facts.is_cuda:
        return ScheduleChoice("reference", f"no GPU ({facts.name}): the fp32 reference path", {})
    if num_experts_per_rank < FUSED_AUTO_MIN_LOCAL_EXPERTS:
        return ScheduleChoice(
            "serial", f"{num_experts_per_rank} local experts < {FUSED_AUTO_MIN_LOCAL_EXPERTS}: the fused kernel "
            "was measured slower than grouped matmul there", {})
    return ScheduleChoice(
        "fused", f"{num_experts_per_rank} local experts >= {FUSED_AUTO_MIN_LOCAL_EXPERTS} on {facts.name}: the "
        "fused kernel was measured faster than grouped matmul there", {})


# At world 1 the EP layer on the general EP plan made NucleusMoE's step slower than diffusers' own layer: the
# kernel alone is faster than grouped matmul, but the general plan reads the routed counts on the host behind
# a sync every layer, and at world 1 nothing hides it. A top-k layer (HiDream) has data-dependent counts, so
# it would need that plan. The timings: benchmarks/results/e2e/NOTES.md ("NucleusMoE at world 1: the EP layer
# made it slower").
WORLD1_MEASURED = ("the EP layer's step was measured slower than diffusers' own at world 1 (its host-side "
                   "routing plan, behind a sync every layer, outweighs the faster kernel; "
                   "benchmarks/results/e2e/NOTES.md)")
MOE_ROUTINGS = ("expert_choice", "top_k")

# NucleusMoE's full-size layer at world 1, per call, at capacity factor 2 (256 rows per expert, 27 of its 29
# MoE blocks) and 4 (512 rows, 2 blocks): compiled (the server's default on a GPU), diffusers' grouped matmul
# fused by Inductor beats the fused kernel at both shapes; eager, the fused path wins only on the two
# capacity-4 blocks. The timings: benchmarks/results/moe/NOTES.md ("World 1, per layer").
WORLD1_EXPERT_CHOICE_MEASURED = (
    "per layer at world 1, compiled, diffusers' layer (int32-offsets fix) was measured faster than the fused EP "
    "path at 256 and 512 rows per expert; eager, the fused path wins only at 512 "
    "(benchmarks/results/moe/NOTES.md, \"World 1, per layer\")")


def choose_moe_world1(facts: DeviceFacts, *, num_experts: int, routing: str, requested: str = "auto") -> ScheduleChoice:
    """World 1 (no experts to exchange): "diffusers" (keep diffusers' MoE layer) or an EP layer path.

    routing: "expert_choice" (NucleusMoE: static expert offsets, the EP layer's world-1 path has no host plan)
    or "top_k" (HiDream: data-dependent counts, the general EP plan with its host sync).
    requested: "auto" keeps diffusers' layer (measured faster on a GPU in both cases:
    ``WORLD1_EXPERT_CHOICE_MEASURED``, ``WORLD1_MEASURED``); an explicit "fused" | "serial" | "reference" swaps
    in the EP layer on that path (`choose_moe_path` rules).
    """
    check_moe_path(requested)
    _check_ints(num_experts=num_experts)
    if routing not in MOE_ROUTINGS:
        raise ValueError(f"expected routing in {MOE_ROUTINGS}, got {routing!r}")
    if requested != "auto":
        return choose_moe_path(facts, num_experts_per_rank=num_experts, requested=requested)
    if not facts.is_cuda:
        return ScheduleChoice("diffusers", f"no GPU ({facts.name}): diffusers' layer", {})
    if routing == "top_k":
        return ScheduleChoice("diffusers", f"{num_experts} experts, top-k routing on {facts.name}: the counts are "
                              f"data-dependent, so the EP layer needs its host-side plan; {WORLD1_MEASURED}", {})
    return ScheduleChoice("diffusers", f"{num_experts} experts, expert-choice routing on {facts.name}: "
                          f"{WORLD1_EXPERT_CHOICE_MEASURED}", {})


def choose_moe_lead(
    xparams,
    facts: DeviceFacts,
    *,
    hidden: int,
    intermediate: int,
    rows_per_expert: int,
    num_experts_per_rank: int,
    dtype_bytes: int,
    block_m: int,
    block_n1: int,
    block_n2: int,
    num_producers: int | None = None,
    tile_flops_per_sm: float = MOE_TILE_FLOPS_PER_SM,
    max_lead: int = 4,
) -> ScheduleChoice:
    """Wave-by-wave or interleaved combine, and the lead ``D`` (DESIGN §2, "reshape").

    Burst: ``K_act = min(K, Linear-2 tiles of a wave)`` producers (``K = num_producers``, default the SMs
    of ``facts``) each emit one Linear-2 tile of combine rows, ``V_t = block_m * block_n2 * dtype_bytes``;
    ``V = K_act * V_t``. Gap: wave-by-wave leaves only the Linear-2 mainloop, ``G_wave = T_L2``;
    interleaving puts ``n1/n2`` Linear-1 tiles between Linear-2 tiles, ``G_int = T_L2 + (n1/n2) * T_L1``
    (tile times from their FLOPs at ``tile_flops_per_sm``). If the design test passes at ``G_wave`` the
    wave order is kept. Otherwise interleave with the smallest lead at or above the dependency floor
    ``1 + ceil(K / tiles_per_wave)`` (a wave's Linear-1 tiles finish before its Linear-2 tiles are taken),
    capped by the cache ceiling (in-flight SwiGLU output of ``D`` waves within half of ``facts.l2_bytes``).

    xparams: ``XStageParams`` of the combine target, or None (no calibration: lead from the floor alone).
    Returns ``ScheduleChoice(name="wave"|"interleaved", reason, {"lead": D, ...})``.
    """
    producers = facts.num_sms if num_producers is None else num_producers
    _check_ints(hidden=hidden, intermediate=intermediate, rows_per_expert=rows_per_expert,
                num_experts_per_rank=num_experts_per_rank, block_m=block_m, block_n1=block_n1, block_n2=block_n2,
                num_producers=producers, dtype_bytes=dtype_bytes, max_lead=max_lead)  # fmt: skip
    n1 = -(-intermediate // block_n1)
    n2 = -(-hidden // block_n2)
    num_blocks = num_experts_per_rank * -(-rows_per_expert // block_m)
    wave_blocks = max(1, -(-producers // n1))
    num_waves = -(-num_blocks // wave_blocks)
    tiles_per_wave = wave_blocks * (n1 + n2)
    t_l1 = 2.0 * block_m * (2 * block_n1) * hidden / tile_flops_per_sm
    t_l2 = 2.0 * block_m * block_n2 * intermediate / tile_flops_per_sm
    k_act = min(producers, wave_blocks * n2)
    volume = float(k_act * block_m * block_n2 * dtype_bytes)
    g_wave = t_l2
    g_int = t_l2 + (n1 / n2) * t_l1
    floor = 1 + -(-producers // tiles_per_wave)
    h_bytes_per_wave = wave_blocks * block_m * intermediate * dtype_bytes
    ceiling = max(1, int(L2_SHARE_FOR_LEAD * facts.l2_bytes // max(1, h_bytes_per_wave)))
    lead = max(1, min(floor, ceiling, max_lead, max(1, num_waves - 1)))
    shape = (f"V = {k_act} x {block_m}x{block_n2} tiles = {volume / 2**20:.2f} MiB, T_L1 {t_l1 * 1e6:.2f} us, "
             f"T_L2 {t_l2 * 1e6:.2f} us, {num_waves} waves of {wave_blocks} blocks")  # fmt: skip
    params = {"lead": lead, "volume_bytes": volume, "gap_wave_s": g_wave, "gap_interleaved_s": g_int,
              "lead_floor": floor, "lead_ceiling": ceiling}  # fmt: skip
    if num_waves < 2:
        return ScheduleChoice("wave", f"one wave only ({shape}): nothing to interleave", {**params, "lead": 0})
    if xparams is None:
        return ScheduleChoice(
            "interleaved",
            f"no X-Stage calibration (CPU, or none cached): lead {lead} from the dependency floor alone; {shape}",
            params,
        )
    from xstage_dit.xstage import design_test

    wave = design_test(xparams, volume, g_wave)
    if wave.ok:
        return ScheduleChoice("wave", f"wave-by-wave passes the design test ({wave.reason}); {shape}", {**params, "lead": 0})
    inter = design_test(xparams, volume, g_int)
    verdict = "passes" if inter.ok else "still fails, but backs up less"
    return ScheduleChoice(
        "interleaved",
        f"wave-by-wave fails ({wave.reason}); interleaved {verdict} ({inter.reason}); lead {lead} "
        f"(dependency floor {floor}, cache ceiling {ceiling}); {shape}",
        {**params, "design_ok": inter.ok},
    )


@dataclass(frozen=True)
class MoESchedule:
    """What an EP layer runs: path "fused" | "serial" | "reference", the fused kernel's lead (0 = wave by
    wave; 0 and unused off the fused path), the reason (one log line), and the lead choice's numbers."""

    path: str
    lead: int
    reason: str
    params: dict = field(default_factory=dict)


def choose_moe_schedule(xparams, facts: DeviceFacts, *, requested: str = "auto", lead: int | None = None,
                        hidden: int, intermediate: int, rows_per_expert: int, num_experts_per_rank: int,
                        dtype_bytes: int, block_m: int, block_n1: int, block_n2: int,
                        num_producers: int | None = None) -> MoESchedule:
    """The path (``choose_moe_path``) and, on the fused path, the lead (``lead`` if given, the user's fixed
    choice, else ``choose_moe_lead``) for one layer shape. Arguments as those two functions."""
    path = choose_moe_path(facts, num_experts_per_rank=num_experts_per_rank, requested=requested)
    if path.name != "fused":
        return MoESchedule(path.name, 0, path.reason)
    if lead is not None:
        if isinstance(lead, bool) or not isinstance(lead, int) or lead < 0:
            raise ValueError(f"expected lead an int >= 0 or None, got {lead!r}")
        return MoESchedule("fused", lead, f"{path.reason}; lead {lead} fixed by the kernel config", {"lead": lead})
    choice = choose_moe_lead(xparams, facts, hidden=hidden, intermediate=intermediate, rows_per_expert=rows_per_expert,
                             num_experts_per_rank=num_experts_per_rank, dtype_bytes=dtype_bytes, block_m=block_m,
                             block_n1=block_n1, block_n2=block_n2, num_producers=num_producers)  # fmt: skip
    return MoESchedule("fused", int(choice.params["lead"]), f"{path.reason}; {choice.name} combine: {choice.reason}",
                       dict(choice.params))


class MoEScheduler:
    """``choose_moe_schedule`` once per layer shape, each decision logged once with its reason.

    One scheduler serves the EP layers of one model (``apply_expert_parallel`` makes it with the params
    ``parallelize`` hands down), so layers of one shape share one decision and one log line.
    ``choices``: every decision so far, by shape key (for reports).
    """

    def __init__(self, xparams=None):
        self.xparams = xparams
        self._choices: dict[tuple, MoESchedule] = {}

    @property
    def choices(self) -> dict[tuple, MoESchedule]:
        return dict(self._choices)

    def choose(self, facts: DeviceFacts, **shape: Any) -> MoESchedule:
        """The schedule for ``shape`` (keyword arguments of ``choose_moe_schedule``) on ``facts``."""
        key = (facts, tuple(sorted(shape.items())))
        got = self._choices.get(key)
        if got is None:
            got = choose_moe_schedule(self.xparams, facts, **shape)
            self._choices[key] = got
            dims = ", ".join(f"{k}={v}" for k, v in sorted(shape.items()))
            log.info("EP MoE schedule (%s on %s): %s, lead %d (%s)", dims, facts.name, got.path, got.lead, got.reason)
        return got
