"""The attention schedule: fused (post-attention All-to-All in the attention epilogue) or serial Ulysses
attention, from the calibrated X-Stage params, the layer shape and the device's facts, with the reason
(DESIGN §2, "How the two kernels use the test").

    choice = choose_attention_schedule(xparams, facts=DeviceFacts.from_device(q.device), batch=1,
                                       seq_len=4608, heads=24, head_dim=128, world_size=4, dtype_bytes=2)
    choice.name, choice.reason                      # "fused" | "serial", one readable line
"""

from __future__ import annotations

from xstage_dit.schedule.choices import ScheduleChoice
from xstage_dit.schedule.facts import DeviceFacts
from xstage_dit.xstage import design_test

__all__ = ["choose_attention_schedule", "FUSED_GPU_VALIDATED_HEAD_DIMS", "FUSED_OVER_CUDNN", "A2A_LATENCY_S",
           "ATTENTION_CUDNN_FLOPS"]


# Dense bf16 attention throughput of cuDNN SDPA, and our fused kernel's relative to it (the minimum over >= 16K
# tokens), rounded from the attention sweep (benchmarks/results/attention/, DESIGN §4): defaults of the design
# test where the machine's own sweep has not run.
ATTENTION_CUDNN_FLOPS = 600e12
FUSED_OVER_CUDNN = 0.88
# Fixed cost of one library All-to-All call (launch + handshake) on NVLink: an assumption (typical NCCL
# small-message latency), not a measurement of ours.
A2A_LATENCY_S = 20e-6


def _check_int(name: str, value: int, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"expected {name} to be an int >= {minimum}, got {value!r}")


# `auto` picks the fused kernel only at head dims the GPU tests passed (benchmarks/results/gpu-tests/). Head_dim 64
# once left rows unwritten; the cause was the 4-warp warp-specialized loop on shards of at most one tile
# (any head_dim), now routed to the plain loop in `_attention_kernel.launch_attention`.
FUSED_GPU_VALIDATED_HEAD_DIMS = (64, 128)


def choose_attention_schedule(xparams, *, facts: DeviceFacts, batch: int, seq_len: int, heads: int, head_dim: int,
                              world_size: int, dtype_bytes: int, t_kv_tile_s: float | None = None,
                              block_m: int = 128, block_n: int = 128,
                              fused_over_cudnn: float = FUSED_OVER_CUDNN,
                              a2a_latency_s: float = A2A_LATENCY_S) -> ScheduleChoice:
    """Fused (post-attention All-to-All in the attention epilogue) or serial Ulysses attention.

    The burst: each of ``K = min(facts.num_sms, tiles)`` producers stores one ``block_m x head_dim`` output
    tile, ``B_t = block_m * head_dim * dtype_bytes`` bytes, ``V = K * B_t``. The gap: a producer's
    next tile comes one whole KV loop later, ``G = ceil(seq_len / block_n) * t_kv_tile``, where
    ``t_kv_tile`` (one ``block_m x block_n`` KV step on one SM) defaults to its FLOPs at the measured
    per-SM attention rate. The design test (rate and capacity bounds) must hold; then fused wins when
    the attention it slows (``1/fused_over_cudnn``) costs less than the All-to-All it hides
    (``a2a_latency_s + V_out / R``).

    xparams: calibrated ``XStageParams`` of the target the tiles go to, or None (no calibration).
    facts: the device the kernel runs on (``DeviceFacts.from_device(q.device)``): its SM count is K.
    dtype_bytes: the element size of q (``q.element_size()``).
    Returns ScheduleChoice(name "fused" | "serial", reason, params with the numbers used).
    """
    for name, value in (("batch", batch), ("seq_len", seq_len), ("heads", heads), ("head_dim", head_dim),
                        ("world_size", world_size), ("dtype_bytes", dtype_bytes), ("block_m", block_m),
                        ("block_n", block_n)):
        _check_int(name, value)
    if not isinstance(facts, DeviceFacts):
        raise ValueError(f"expected facts to be a DeviceFacts (read off the device), got {type(facts).__name__}")
    num_sms = facts.num_sms
    if t_kv_tile_s is not None and not (isinstance(t_kv_tile_s, (int, float)) and t_kv_tile_s > 0):
        raise ValueError(f"expected t_kv_tile_s > 0 seconds or None, got {t_kv_tile_s!r}")
    if not 0 < fused_over_cudnn <= 2:
        raise ValueError(f"expected fused_over_cudnn in (0, 2], got {fused_over_cudnn!r}")
    if world_size == 1:
        # Decided without the calibration (none is needed): there is nothing to hide.
        return ScheduleChoice(
            "serial",
            "world size 1: no post-attention All-to-All to hide, and single-GPU cuDNN SDPA is faster "
            f"than the fused kernel (measured {fused_over_cudnn:.2f}x)", {"world_size": 1})
    if xparams is None:
        return ScheduleChoice("serial", "no X-Stage calibration available (CPU or no GPU): serial schedule", {})
    if head_dim not in FUSED_GPU_VALIDATED_HEAD_DIMS:
        return ScheduleChoice(
            "serial", f"head_dim {head_dim}: the fused kernel is GPU-validated only at head_dim "
            f"{FUSED_GPU_VALIDATED_HEAD_DIMS}: serial schedule",
            {"head_dim": head_dim})

    heads_local = -(-heads // world_size)
    chunk = -(-seq_len // world_size)
    tiles = -(-world_size * chunk // block_m) * batch * heads_local
    producers = min(num_sms, tiles)
    tile_bytes = block_m * head_dim * dtype_bytes
    volume = producers * tile_bytes
    kv_tiles = -(-seq_len // block_n)
    if t_kv_tile_s is None:
        t_kv_tile_s = 4.0 * block_m * block_n * head_dim / (ATTENTION_CUDNN_FLOPS * fused_over_cudnn / num_sms)
    gap = kv_tiles * t_kv_tile_s
    test = design_test(xparams, volume, gap)
    flops = 4.0 * batch * heads_local * (world_size * chunk) * seq_len * head_dim
    t_attention = flops / ATTENTION_CUDNN_FLOPS
    out_bytes_remote = batch * heads_local * (world_size * chunk) * head_dim * dtype_bytes * (world_size - 1) / world_size
    t_post_a2a = a2a_latency_s + out_bytes_remote / xparams.drain_rate_Bps
    t_fused = t_attention / fused_over_cudnn
    t_serial = t_attention + t_post_a2a
    params = {
        "burst_bytes": volume, "producers": producers, "tile_bytes": tile_bytes, "gap_s": gap,
        "recovery_gap_s": test.recovery_gap_s, "rate_ok": test.rate_ok, "capacity_ok": test.capacity_ok,
        "t_kv_tile_s": t_kv_tile_s, "predicted_fused_s": t_fused, "predicted_serial_s": t_serial,
    }
    shape = f"burst {volume / 2**20:.2f} MiB from {producers} producers every {gap * 1e6:.1f} us"
    if not test.ok:
        return ScheduleChoice("serial", f"design test fails ({shape}): {test.reason}", params)
    if t_fused > t_serial:
        return ScheduleChoice(
            "serial", f"design test holds ({shape}), but the fused kernel's slower attention "
            f"({t_fused * 1e6:.0f} us) costs more than the All-to-All it hides (serial {t_serial * 1e6:.0f} us)", params)
    return ScheduleChoice(
        "fused", f"design test holds ({shape}): {test.reason}; predicted fused {t_fused * 1e6:.0f} us "
        f"<= serial {t_serial * 1e6:.0f} us", params)


