"""The MoE schedule chooser (xstage_dit.schedule.moe): the path rule, the lead from the design test, the
combined choice and the once-per-shape scheduler. Pure Python: no GPU, no kernels."""

from __future__ import annotations

import pytest

from xstage_dit.schedule.facts import DeviceFacts
from xstage_dit.schedule.moe import (
    FUSED_AUTO_MIN_LOCAL_EXPERTS,
    MoEScheduler,
    choose_moe_lead,
    choose_moe_path,
    choose_moe_schedule,
)
from xstage_dit.xstage import XStageParams

# The machine the served shapes run on, as DeviceFacts.from_device reads it off an H200.
H200 = DeviceFacts(name="NVIDIA H200", num_sms=132, l2_bytes=60 * 2**20, compute_capability=(9, 0), is_cuda=True)
CPU = DeviceFacts.cpu()
BLOCKS = dict(block_m=128, block_n1=128, block_n2=128)
NUCLEUS = dict(hidden=2048, intermediate=1344, rows_per_expert=256, num_experts_per_rank=128, dtype_bytes=2, **BLOCKS)


def test_auto_path_takes_fused_only_where_measured_faster():
    assert choose_moe_path(CPU, num_experts_per_rank=128).name == "reference"
    assert choose_moe_path(H200, num_experts_per_rank=128).name == "fused"  # NucleusMoE, one rank
    hidream = choose_moe_path(H200, num_experts_per_rank=FUSED_AUTO_MIN_LOCAL_EXPERTS - 1)
    assert hidream.name == "serial" and "measured slower" in hidream.reason
    assert choose_moe_path(H200, num_experts_per_rank=64).name == "fused"  # NucleusMoE, 2 ranks
    assert choose_moe_path(H200, num_experts_per_rank=1).name == "serial"  # HiDream, 4 ranks
    assert choose_moe_path(H200, num_experts_per_rank=4, requested="fused").name == "fused"  # explicit: honoured
    assert choose_moe_path(CPU, num_experts_per_rank=4, requested="serial").name == "serial"
    with pytest.raises(ValueError, match="expected path in .*got 'fast'"):
        choose_moe_path(H200, num_experts_per_rank=4, requested="fast")
    with pytest.raises(RuntimeError, match="path='fused' needs CUDA tensors, got cpu"):
        choose_moe_path(CPU, num_experts_per_rank=128, requested="fused")


def test_choose_moe_lead_without_calibration_says_so():
    c = choose_moe_lead(None, H200, **NUCLEUS)
    assert c.name == "interleaved" and "no X-Stage calibration" in c.reason
    assert c.params["lead"] >= 1


def test_choose_moe_lead_wave_when_drain_keeps_up():
    fast = XStageParams(132, 1e-6, 5e12, 5e12, float("inf"))  # local HBM: drains as fast as it issues
    c = choose_moe_lead(fast, H200, **NUCLEUS)
    assert c.name == "wave" and c.params["lead"] == 0 and "passes" in c.reason


def test_choose_moe_lead_interleaves_when_rate_bound_fails():
    slow = XStageParams(132, 0.0, 4.0e12, 150e9, 4 * 2**20)  # burst drains much slower than it issues
    c = choose_moe_lead(slow, H200, **NUCLEUS)
    assert c.name == "interleaved" and "wave-by-wave fails" in c.reason
    assert c.params["gap_interleaved_s"] > c.params["gap_wave_s"]
    assert 1 <= c.params["lead"] <= c.params["lead_ceiling"]


def test_choose_moe_lead_reads_producers_cache_and_width_from_its_inputs():
    """The burst is K = the device's SMs producers of dtype-wide tiles; the ceiling is half its L2."""
    half = DeviceFacts(name="half", num_sms=66, l2_bytes=60 * 2**20, compute_capability=(9, 0), is_cuda=True)
    assert choose_moe_lead(None, half, **NUCLEUS).params["volume_bytes"] == 66 * 128 * 128 * 2
    assert choose_moe_lead(None, H200, **{**NUCLEUS, "dtype_bytes": 4}).params["volume_bytes"] == 132 * 128 * 128 * 4
    small_l2 = DeviceFacts(name="small", num_sms=132, l2_bytes=2**20, compute_capability=(9, 0), is_cuda=True)
    assert choose_moe_lead(None, small_l2, **NUCLEUS).params["lead_ceiling"] == 1
    assert choose_moe_lead(None, H200, **NUCLEUS).params["lead_ceiling"] > 1


def test_choose_moe_lead_validates():
    with pytest.raises(ValueError, match="expected hidden to be an int >= 1, got 0"):
        choose_moe_lead(None, H200, **{**NUCLEUS, "hidden": 0})
    with pytest.raises(ValueError, match="expected dtype_bytes to be an int >= 1, got 0"):
        choose_moe_lead(None, H200, **{**NUCLEUS, "dtype_bytes": 0})


def test_schedule_combines_path_and_lead():
    s = choose_moe_schedule(None, H200, **NUCLEUS)
    assert s.path == "fused" and s.lead == choose_moe_lead(None, H200, **NUCLEUS).params["lead"]
    assert "fused kernel was measured faster" in s.reason and "no X-Stage calibration" in s.reason
    fixed = choose_moe_schedule(None, H200, lead=3, **NUCLEUS)
    assert (fixed.path, fixed.lead) == ("fused", 3) and "fixed by the kernel config" in fixed.reason
    off = choose_moe_schedule(None, CPU, **NUCLEUS)
    assert (off.path, off.lead) == ("reference", 0)
    with pytest.raises(ValueError, match="expected lead an int >= 0 or None, got -2"):
        choose_moe_schedule(None, H200, lead=-2, **NUCLEUS)


def test_scheduler_decides_once_per_shape_and_logs_once(caplog):
    sched = MoEScheduler(None)
    with caplog.at_level("INFO", logger="xstage_dit.schedule.moe"):
        a = sched.choose(H200, **NUCLEUS)
        b = sched.choose(H200, **NUCLEUS)
        c = sched.choose(H200, **{**NUCLEUS, "rows_per_expert": 512})
    assert a is b and c is not a and len(sched.choices) == 2
    lines = [r.getMessage() for r in caplog.records if "EP MoE schedule" in r.getMessage()]
    assert len(lines) == 2 and all("fused" in line for line in lines), lines


def test_world1_choice_by_layer_kind_unless_a_path_is_requested():
    """"auto" keeps diffusers' layer for both kinds on a GPU, each for its measured reason, and on the CPU; an
    explicit path is honoured for either kind."""
    from xstage_dit.schedule.moe import choose_moe_world1

    assert choose_moe_world1(CPU, num_experts=64, routing="expert_choice").name == "diffusers"
    nucleus = choose_moe_world1(H200, num_experts=64, routing="expert_choice")
    # measured: diffusers' layer compiled (offsets fix) beat the fused EP path at both NucleusMoE shapes
    assert nucleus.name == "diffusers" and "compiled" in nucleus.reason, nucleus
    assert "benchmarks/results/moe/NOTES.md" in nucleus.reason, nucleus  # the measurement, in its results file
    assert choose_moe_world1(H200, num_experts=4, routing="expert_choice").name == "diffusers"
    hidream = choose_moe_world1(H200, num_experts=4, routing="top_k")
    assert hidream.name == "diffusers" and "top-k" in hidream.reason and "measured slower" in hidream.reason
    assert "benchmarks/results/e2e/NOTES.md" in hidream.reason, hidream
    assert choose_moe_world1(H200, num_experts=128, routing="top_k", requested="fused").name == "fused"
    assert choose_moe_world1(H200, num_experts=64, routing="expert_choice", requested="serial").name == "serial"
    with pytest.raises(ValueError, match="fast"):
        choose_moe_world1(H200, num_experts=128, routing="top_k", requested="fast")
    with pytest.raises(ValueError, match="expected routing in .* got 'topk'"):
        choose_moe_world1(H200, num_experts=128, routing="topk")
