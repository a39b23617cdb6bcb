"""`schedule.attention.choose_attention_schedule` and `schedule.facts.DeviceFacts`, on the CPU: the design
test's outcomes and reasons, fed facts read off a (fake) device rather than remembered literals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from xstage_dit.schedule import DeviceFacts, ScheduleChoice, choose_attention_schedule
from xstage_dit.schedule.attention import FUSED_GPU_VALIDATED_HEAD_DIMS
from xstage_dit.xstage import XStageParams

# What torch.cuda.get_device_properties returns, for an H200-like and a half-size GPU.
H200_PROPS = SimpleNamespace(name="NVIDIA H200", multi_processor_count=132, L2_cache_size=60 * 2**20, major=9,
                             minor=0)
SMALL_PROPS = SimpleNamespace(name="half", multi_processor_count=66, L2_cache_size=30 * 2**20, major=9, minor=0)
H200 = DeviceFacts.from_props(H200_PROPS)
KW = dict(facts=H200, batch=1, heads=24, head_dim=128, world_size=8, dtype_bytes=2)


def test_facts_come_from_the_device_properties():
    assert H200 == DeviceFacts("NVIDIA H200", 132, 60 * 2**20, (9, 0), True)
    assert DeviceFacts.from_device("cpu") == DeviceFacts.cpu()
    assert DeviceFacts.cpu().num_sms == 1 and not DeviceFacts.cpu().is_cuda
    with pytest.raises(ValueError, match="num_sms >= 1, got 0"):
        DeviceFacts("x", 0, 0, (0, 0), False)


def test_without_calibration_the_choice_says_so():
    c = choose_attention_schedule(None, seq_len=4608, **KW)
    assert c == ScheduleChoice("serial", "no X-Stage calibration available (CPU or no GPU): serial schedule", {})


def test_design_test_outcomes():
    ref = XStageParams.reference()
    # Long sequence, fused kernel as fast as cuDNN: the design test holds and fused wins.
    c = choose_attention_schedule(ref, seq_len=32768, fused_over_cudnn=1.0, **KW)
    assert c.name == "fused" and c.params["rate_ok"] and c.params["capacity_ok"], c.reason
    # A gap shorter than G*: the rate bound fails and the reason says so.
    c = choose_attention_schedule(ref, seq_len=256, t_kv_tile_s=1e-7, **KW)
    assert c.name == "serial" and "rate bound fails" in c.reason
    # A slow drain (PCIe-like) with many producers overflows the stage: capacity bound fails.
    slow = XStageParams(num_producers=132, t_iss0_fixed_s=1e-6, issue_rate_Bps=5e12, drain_rate_Bps=55e9,
                        capacity_bytes=1e6)
    c = choose_attention_schedule(slow, seq_len=65536, **KW)
    assert c.name == "serial" and "capacity bound fails" in c.reason
    # Design test holds but a slow fused kernel costs more than the All-to-All it hides.
    c = choose_attention_schedule(ref, seq_len=65536, fused_over_cudnn=0.5, **KW)
    assert c.name == "serial" and "costs more" in c.reason
    # World size 1: nothing to hide.
    c = choose_attention_schedule(ref, seq_len=4608, **{**KW, "world_size": 1})
    assert c.name == "serial" and "world size 1" in c.reason


def test_the_burst_is_one_tile_per_sm_of_the_device():
    ref = XStageParams.reference()
    big = choose_attention_schedule(ref, seq_len=32768, fused_over_cudnn=1.0, **KW)
    small = choose_attention_schedule(ref, seq_len=32768, fused_over_cudnn=1.0,
                                      **{**KW, "facts": DeviceFacts.from_props(SMALL_PROPS)})
    assert big.params["producers"] == 132 and small.params["producers"] == 66
    assert big.params["burst_bytes"] == 132 * 128 * 128 * 2 and small.params["burst_bytes"] == 66 * 128 * 128 * 2
    # fp32 tiles are twice the bytes: dtype_bytes is the tensor's, not a constant
    wide = choose_attention_schedule(ref, seq_len=32768, fused_over_cudnn=1.0, **{**KW, "dtype_bytes": 4})
    assert wide.params["tile_bytes"] == 2 * big.params["tile_bytes"]
    # the KV step is timed at the measured device rate shared by the device's SMs (ATTENTION_CUDNN_FLOPS / num_sms)
    assert small.params["t_kv_tile_s"] == pytest.approx(big.params["t_kv_tile_s"] / 2)


def test_gpu_unvalidated_head_dims_stay_serial():
    ref = XStageParams.reference()
    kw = {**KW, "seq_len": 32768, "fused_over_cudnn": 1.0}
    assert choose_attention_schedule(ref, **{**kw, "head_dim": 128}).name == "fused"
    assert choose_attention_schedule(ref, **{**kw, "head_dim": 64}).name == "fused"
    c = choose_attention_schedule(ref, **{**kw, "head_dim": 256})
    assert 256 not in FUSED_GPU_VALIDATED_HEAD_DIMS
    assert c.name == "serial" and "head_dim 256" in c.reason


def test_bad_input_names_the_value():
    ref = XStageParams.reference()
    with pytest.raises(ValueError, match="seq_len to be an int >= 1, got 0"):
        choose_attention_schedule(ref, seq_len=0, **{k: v for k, v in KW.items()})
    with pytest.raises(ValueError, match="facts to be a DeviceFacts.*got int"):
        choose_attention_schedule(ref, seq_len=4608, **{**KW, "facts": 132})
    with pytest.raises(TypeError):
        choose_attention_schedule(ref, seq_len=4608, batch=1, heads=24, head_dim=128, world_size=8, dtype_bytes=2)
