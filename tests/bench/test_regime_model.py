"""CPU tests of the X-Stage regime benchmark's model side (benchmarks/regime_model.py) and its report."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import regime_model as rm  # noqa: E402
from benchmarks.regime_report import write_report  # noqa: E402
from xstage_dit.schedule.facts import DeviceFacts  # noqa: E402
from xstage_dit.xstage import XStageParams, design_test  # noqa: E402

# Host-pinned-like numbers (calibration/h200-cacf07f: R 54 GB/s, Q 3.9 MiB) on a 132-SM GPU.
HOST = XStageParams(num_producers=132, t_iss0_fixed_s=2e-6, issue_rate_Bps=2e12, drain_rate_Bps=54e9,
                    capacity_bytes=3.9 * 2**20)
FACTS = DeviceFacts(name="test", num_sms=132, l2_bytes=60 * 2**20, compute_capability=(9, 0), is_cuda=True)
T_KV = 1.9e-6  # one 128x128x128 KV step at ~600 TFLOP/s over 132 SMs


def _t_local(m: int, heads: int = 24) -> float:
    tiles = heads * -(-m // 128)
    return -(-tiles // 132) * -(-m // 128) * T_KV


def test_fast_drain_and_infinite_capacity_cost_nothing():
    free = XStageParams(132, 2e-6, 2e12, 1e15, math.inf)
    out = rm.burst_train(free, [4e6] * 5, 1e-6)
    assert out["issue_overhead_s"] == 0 and out["tail_s"] == 0 and not out["backs_up"]


def test_attention_backs_up_below_the_threshold_and_not_above():
    geometry = dict(batch=1, heads=24, head_dim=128, block=128, dtype_bytes=2, t_kv_tile_s=T_KV)
    # A full-wave burst (132 x 32 KiB = 4.3 MB) is a little over Q: the capacity bound fails at every M, so
    # the strict design test gives no M*; a larger Q gives one.
    assert rm.predicted_threshold(HOST, FACTS, **geometry) is None
    roomy = XStageParams(132, 2e-6, 2e12, 54e9, 8 * 2**20)
    m_star = rm.predicted_threshold(roomy, FACTS, **geometry)
    assert m_star is not None and 1024 < m_star < 32768
    knee = rm.predicted_knee(HOST, FACTS, pct=2.0, **geometry)
    assert knee is not None and 1024 < knee < 131072
    short = rm.attention_prediction(HOST, FACTS, batch=1, seq_len=1024, heads=24, head_dim=128, block=128,
                                    dtype_bytes=2, t_local_s=_t_local(1024))
    long = rm.attention_prediction(HOST, FACTS, batch=1, seq_len=32768, heads=24, head_dim=128, block=128,
                                   dtype_bytes=2, t_local_s=_t_local(32768))
    assert short["predicted_backs_up"] and short["predicted_issue_overhead_us"] > 0
    assert short["predicted_residual_us"] / (_t_local(1024) * 1e6) > long["predicted_residual_us"] / (_t_local(32768) * 1e6)
    assert short["t_kv_tile_s"] == pytest.approx(T_KV) and long["t_kv_tile_s"] == pytest.approx(T_KV)
    # The burst of a full wave: 132 producers x one 128x128 bf16 tile.
    assert long["burst_bytes"] == 132 * 128 * 128 * 2
    # Above M* the design test holds for the full-wave burst; just below it fails.
    for m, ok in ((m_star, True), (m_star - 128, False)):
        gap = -(-m // 128) * T_KV
        assert design_test(roomy, 132 * 32768, gap).ok is ok
    # With room in the stage, only the tail is left at long M.
    roomy_long = rm.attention_prediction(roomy, FACTS, batch=1, seq_len=32768, heads=24, head_dim=128, block=128,
                                         dtype_bytes=2, t_local_s=_t_local(32768))
    assert not roomy_long["predicted_backs_up"]
    assert roomy_long["predicted_issue_overhead_us"] == 0 and roomy_long["predicted_tail_us"] > 0


def test_interleaving_widens_the_gap_and_cuts_the_predicted_overhead():
    kw = dict(hidden=2048, intermediate=512, experts=32, rows_per_expert=256, t_local_s=300e-6)
    wave = rm.moe_prediction(HOST, FACTS, lead=0, **kw)
    inter = rm.moe_prediction(HOST, FACTS, lead=2, **kw)
    assert inter["gap_us"] > wave["gap_us"]
    assert wave["rate_bound_fails"]  # V/R >> T_L2 at 54 GB/s
    assert inter["predicted_overhead_us"] <= wave["predicted_overhead_us"]
    # The tile times add up to the local timing: every producer's share of the tiles.
    n1, n2, blocks = 4, 16, 32 * 2
    total = blocks * (n1 * wave["t_l1_us"] + n2 * wave["t_l2_us"]) / 132
    assert total == pytest.approx(300.0)


def test_knee_and_mape():
    rows = [{"seq_len": m, "residual_pct": p} for m, p in ((1024, 40.0), (4096, 5.0), (8192, 1.5), (16384, 2.5),
                                                          (32768, 0.5))]
    assert rm.measured_knee(rows, 3.0) == 8192
    assert rm.measured_knee(rows, 1.0) == 32768
    assert rm.measured_knee([{"seq_len": 1, "residual_pct": 9.0}], 1.0) is None
    assert rm.mape([(110.0, 100.0), (90.0, 100.0), (5.0, -1.0)]) == pytest.approx(10.0)
    assert rm.mape([]) is None


def test_report_writes_json_markdown_and_two_plots(tmp_path):
    attn = []
    for m in (1024, 4096, 16384):
        pred = rm.attention_prediction(HOST, FACTS, batch=1, seq_len=m, heads=24, head_dim=128, block=128,
                                       dtype_bytes=2, t_local_s=_t_local(m))
        attn.append({"seq_len": m, "heads": 24, "ms_local": _t_local(m) * 1e3, "ms_fused_host": _t_local(m) * 1.1e3,
                     "ms_serial_host": _t_local(m) * 1.2e3, "residual_us": _t_local(m) * 1e5,
                     "residual_pct": 10.0, "chosen": "serial", "measured_best": "fused", "choice_agrees": False,
                     **pred})
    leads = [{"lead": d, "ms_local": 0.3, "ms_host": 0.6, "overhead_us": 300.0,
              **rm.moe_prediction(HOST, FACTS, hidden=2048, intermediate=512, experts=32, rows_per_expert=256,
                                  lead=d, t_local_s=300e-6)} for d in (0, 1)]
    moe = [{"shape": "inter-512", "leads": leads, "rate_bound_fails_wave": True, "interleaved_over_wave": 1.0,
            "chosen_lead": 1, "best_lead": 0, "chosen_over_best": 1.0}]
    data = {"environment": {"gpu": "NVIDIA H200", "git_commit": "abcdef0123"}, "host_params": HOST.to_dict(),
            "t_kv_tile_s": T_KV, "attention": attn, "moe": moe,
            "summary": {"attention_predicted_m_star": 6144, "attention_predicted_knee": 8192, "attention_knee_pct": 2.0,
                        "attention_measured_knee": None,
                        "attention_knee_within_25pct": False, "attention_residual_mape_backed_up_pct": None,
                        "attention_choice_agreement": 0.0, "moe_overhead_mape_backed_up_pct": 12.0,
                        "moe_interleaved_faster_where_rate_fails": False,
                        "moe_interleaved_not_slower_where_rate_holds": None, "moe_chosen_lead_within_10pct": True}}
    paths = write_report(tmp_path, data)
    assert [p.name for p in paths] == ["h200-abcdef0.json", "h200-abcdef0.md", "h200-abcdef0-attention.png",
                                       "h200-abcdef0-moe.png"]
    assert json.loads(paths[0].read_text())["summary"]["attention_predicted_m_star"] == 6144
    md = paths[1].read_text()
    assert "| 16384 |" in md and "M* (both bounds hold from there on) = 6144" in md and "inter-512" in md
    assert all(p.stat().st_size > 1000 for p in paths[2:])
