"""What the X-Stage model predicts for the fused kernels' bursts (DESIGN §2), for bench_xstage_regime.py.

Pure Python on the calibrated ``XStageParams``; CPU-tested (tests/bench/test_regime_model.py). Both kernels
are a train of aligned bursts: ``K`` producers (one program per SM) each store one tile, then compute for a
gap ``G`` before the next. The sender-side cost the model predicts is the issue overhead summed over one
producer's bursts (all producers run in parallel), plus the tail: at the kernel's end its last stores must
still drain from the stage.

- attention: a tile is ``b_m x d`` outputs; ``G`` = one Q-loop = ``ceil(M / b_n)`` KV tiles, the KV-tile time
  taken from the kernel's own local timing (``t_local / (waves * kv_tiles)``);
- MoE: a Linear-2 tile emits ``b_m x b_n2`` combine rows; ``G = T_L2`` wave by wave, ``T_L2 + (n1/n2) T_L1``
  interleaved (lead >= 1); ``T_L1 : T_L2`` from their FLOPs, scaled so the tiles add up to the local timing.
"""

from __future__ import annotations

import math

from xstage_dit.xstage import design_test, isolated_issue_time, issue_time

__all__ = ["attention_prediction", "predicted_threshold", "predicted_knee", "measured_knee", "moe_prediction", "mape", "burst_train"]


def burst_train(params, volumes: list[float], gap_s: float) -> dict:
    """Issue overhead (s) of one producer's bursts ``volumes`` (the first meets an empty stage), the tail
    drain after the last one, and whether any burst backs up."""
    extra, backs_up, last_issue = 0.0, False, 0.0
    for i, v in enumerate(volumes):
        t0 = params.t_iss0(v)
        t = isolated_issue_time(params, v) if i == 0 else issue_time(params, v, gap_s)
        extra += t - t0
        backs_up = backs_up or not design_test(params, v, gap_s).ok
        last_issue = t
    v = volumes[-1] if volumes else 0.0
    outstanding = max(0.0, min(params.capacity_bytes, v - params.drain_rate_Bps * last_issue))
    return {"issue_overhead_s": extra, "tail_s": outstanding / params.drain_rate_Bps, "backs_up": backs_up}


def _attention_geometry(facts, batch: int, seq_len: int, heads: int, head_dim: int, block: int, dtype_bytes: int):
    q_tiles = -(-seq_len // block)
    tiles = batch * heads * q_tiles
    producers = min(facts.num_sms, tiles)
    waves = -(-tiles // producers)
    tile_bytes = block * head_dim * dtype_bytes
    volumes = [float(producers * tile_bytes)] * (waves - 1) + [float((tiles - (waves - 1) * producers) * tile_bytes)]
    return {"tiles": tiles, "producers": producers, "waves": waves, "kv_tiles": -(-seq_len // block),
            "tile_bytes": tile_bytes, "volumes": volumes}


def attention_prediction(params, facts, *, batch: int, seq_len: int, heads: int, head_dim: int, block: int,
                         dtype_bytes: int, t_local_s: float) -> dict:
    """The model's numbers for one attention point, from its local timing ``t_local_s``."""
    g = _attention_geometry(facts, batch, seq_len, heads, head_dim, block, dtype_bytes)
    t_kv = t_local_s / (g["waves"] * g["kv_tiles"])
    gap = g["kv_tiles"] * t_kv
    train = burst_train(params, g["volumes"], gap)
    test = design_test(params, g["volumes"][0], gap)
    return {
        "producers": g["producers"], "waves": g["waves"], "burst_bytes": g["volumes"][0], "t_kv_tile_s": t_kv,
        "gap_us": gap * 1e6, "recovery_gap_us": test.recovery_gap_s * 1e6, "rate_ok": test.rate_ok,
        "capacity_ok": test.capacity_ok, "predicted_backs_up": train["backs_up"],
        "predicted_issue_overhead_us": train["issue_overhead_s"] * 1e6, "predicted_tail_us": train["tail_s"] * 1e6,
        "predicted_residual_us": (train["issue_overhead_s"] + train["tail_s"]) * 1e6,
    }


def predicted_threshold(params, facts, *, batch: int, heads: int, head_dim: int, block: int, dtype_bytes: int,
                        t_kv_tile_s: float, max_seq: int = 131072) -> int | None:
    """M*: the smallest sequence length (a multiple of ``block``) from which every longer one passes the
    design test for its full-wave burst and Q-loop gap; None if none up to ``max_seq``."""
    m_star = None
    for m in range(max_seq, 0, -block):
        g = _attention_geometry(facts, batch, m, heads, head_dim, block, dtype_bytes)
        if not design_test(params, g["volumes"][0], g["kv_tiles"] * t_kv_tile_s).ok:
            break
        m_star = m
    return m_star


def predicted_knee(params, facts, *, batch: int, heads: int, head_dim: int, block: int, dtype_bytes: int,
                   t_kv_tile_s: float, pct: float, max_seq: int = 131072) -> int | None:
    """The model's knee: the smallest M (a multiple of ``block``) from which the predicted residual (issue
    overhead + tail) stays at or under ``pct`` percent of the kernel's time. Unlike ``predicted_threshold``
    it also counts how much a failed bound costs: a burst a few percent over Q backs up by microseconds."""
    knee = None
    for m in range(max_seq, 0, -block):
        g = _attention_geometry(facts, batch, m, heads, head_dim, block, dtype_bytes)
        t_local = g["waves"] * g["kv_tiles"] * t_kv_tile_s
        pred = attention_prediction(params, facts, batch=batch, seq_len=m, heads=heads, head_dim=head_dim,
                                    block=block, dtype_bytes=dtype_bytes, t_local_s=t_local)
        if pred["predicted_residual_us"] * 1e-6 > pct / 100.0 * t_local:
            break
        knee = m
    return knee


def measured_knee(rows: list[dict], pct: float) -> int | None:
    """The smallest measured M from which the residual stays at or under ``pct`` percent (None if never)."""
    knee = None
    for r in sorted(rows, key=lambda r: -r["seq_len"]):
        if r["residual_pct"] > pct:
            break
        knee = r["seq_len"]
    return knee


def moe_prediction(params, facts, *, hidden: int, intermediate: int, experts: int, rows_per_expert: int, lead: int,
                   t_local_s: float, block_m: int = 128, block_n1: int = 128, block_n2: int = 128,
                   dtype_bytes: int = 2) -> dict:
    """The model's numbers for the fused expert MLP at one lead, from its local timing ``t_local_s``."""
    k = facts.num_sms
    n1, n2 = -(-intermediate // block_n1), -(-hidden // block_n2)
    num_blocks = experts * -(-rows_per_expert // block_m)
    wave_blocks = max(1, -(-k // n1))
    f_l1 = 2.0 * block_m * (2 * block_n1) * hidden
    f_l2 = 2.0 * block_m * block_n2 * intermediate
    # Seconds per FLOP of one producer, so that its share of all tiles takes the measured local time.
    s_per_flop = t_local_s * k / (num_blocks * (n1 * f_l1 + n2 * f_l2))
    t_l1, t_l2 = f_l1 * s_per_flop, f_l2 * s_per_flop
    k_act = min(k, wave_blocks * n2)
    volume = float(k_act * block_m * block_n2 * dtype_bytes)
    gap = t_l2 if lead == 0 else t_l2 + (n1 / n2) * t_l1
    bursts = max(1, -(-(num_blocks * n2) // k_act))
    train = burst_train(params, [volume] * bursts, gap)
    wave_test = design_test(params, volume, t_l2)
    return {
        "burst_bytes": volume, "bursts_per_producer": bursts, "t_l1_us": t_l1 * 1e6, "t_l2_us": t_l2 * 1e6,
        "gap_us": gap * 1e6, "rate_bound_fails": not wave_test.rate_ok,
        "predicted_backs_up": train["backs_up"],
        "predicted_overhead_us": (train["issue_overhead_s"] + train["tail_s"]) * 1e6,
    }


def mape(pairs: list[tuple[float, float]]) -> float | None:
    """Mean absolute percentage error of (predicted, measured) pairs with a positive measurement."""
    used = [(p, m) for p, m in pairs if m > 0 and math.isfinite(p)]
    if not used:
        return None
    return 100.0 * sum(abs(p - m) / m for p, m in used) / len(used)
