"""CPU checks of the public Ulysses attention API: reference, serial path at world 1, validation
messages, the custom op (opcheck, fake tensors), and the attention schedule chooser."""

from __future__ import annotations

import math

import pytest
import torch

from xstage_dit.ops.attention.op import (attention_reference, head_split, shard_bounds, ulysses_attention,
                                              ulysses_attention_reference)


def _naive(q, k, v, scale):
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.double())


def test_reference_is_softmax_attention():
    q, k, v = (torch.randn(2, 13, 3, 8) for _ in range(3))
    out = ulysses_attention_reference(q, k, v, scale=0.3)
    torch.testing.assert_close(out.double(), _naive(q, k, v, 0.3), rtol=1e-5, atol=1e-5)
    # Default scale is 1/sqrt(head_dim).
    torch.testing.assert_close(attention_reference(q, k, v).double(), _naive(q, k, v, 1 / math.sqrt(8)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule", ["serial", "auto"])
def test_world1_serial_matches_reference(schedule):
    q, k, v = (torch.randn(1, 17, 2, 16) for _ in range(3))
    out = ulysses_attention(q, k, v, schedule=schedule)
    torch.testing.assert_close(out, attention_reference(q, k, v), rtol=1e-5, atol=1e-5)


def test_auto_on_cpu_records_why_serial():
    from xstage_dit.ops.attention.op import last_schedule_choice

    q = torch.randn(1, 8, 2, 16)
    ulysses_attention(q, q, q, schedule="auto")
    assert last_schedule_choice().name == "serial" and "float16 or bfloat16" in last_schedule_choice().reason
    q = q.bfloat16()
    ulysses_attention(q, q, q, schedule="auto")
    assert last_schedule_choice().name == "serial" and "CUDA" in last_schedule_choice().reason


def test_partitions():
    assert shard_bounds(10, 4) == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert shard_bounds(3, 4) == [(0, 1), (1, 1), (2, 1), (3, 0)]
    assert [len(c) for c in torch.arange(10).chunk(4)] == [n for _, n in shard_bounds(10, 4)]
    assert head_split(5, 2) == [(0, 3), (3, 2)]
    assert head_split(6, 4) == [(0, 2), (2, 2), (4, 1), (5, 1)]
    with pytest.raises(ValueError, match="heads >= world size"):
        head_split(3, 4)


@pytest.mark.parametrize(
    "kwargs, shapes, match",
    [
        ({}, [(2, 8, 2, 16), (2, 8, 2, 16), (2, 9, 2, 16)], "one shape"),
        ({}, [(8, 2, 16)] * 3, "batch, seq_local, heads, head_dim"),
        ({"schedule": "fast"}, [(1, 8, 2, 16)] * 3, "schedule in"),
        ({"scale": -1.0}, [(1, 8, 2, 16)] * 3, "positive finite"),
        ({"seq_len": 9}, [(1, 8, 2, 16)] * 3, "hold 9 tokens"),
    ],
)
def test_validation_names_the_bad_value(kwargs, shapes, match):
    q, k, v = (torch.randn(*s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        ulysses_attention(q, k, v, **kwargs)


def test_fused_refuses_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA device"):
        ulysses_attention(q, q, q, schedule="fused")


def test_custom_op_opcheck_and_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = (torch.randn(1, 12, 2, 16) for _ in range(3))
    torch.library.opcheck(torch.ops.xstage_dit.ulysses_attention.default, (q, k, v, "", "serial", None, None),
                          test_utils=("test_schema", "test_faketensor"))
    with FakeTensorMode():
        fq = torch.empty(2, 4608, 24, 128, dtype=torch.bfloat16)
        out = torch.ops.xstage_dit.ulysses_attention(fq, fq, fq, "", "fused", None, None)
        assert out.shape == fq.shape and out.dtype == fq.dtype


def test_compile_traces_the_op():
    q, k, v = (torch.randn(1, 12, 2, 16) for _ in range(3))
    fn = torch.compile(lambda a, b, c: ulysses_attention(a * 2.0, b, c, schedule="serial"), backend="eager",
                       fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), attention_reference(q * 2.0, k, v), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- schedule


def test_schedule_without_calibration_says_so():
    from xstage_dit.schedule.choices import choose_attention_schedule

    c = choose_attention_schedule(None, batch=1, seq_len=4608, heads=24, head_dim=128, world_size=8, dtype_bytes=2)
    assert c.name == "serial" and "no X-Stage calibration" in c.reason


def test_schedule_design_test_outcomes():
    xstage = pytest.importorskip("xstage_dit.xstage")
    from xstage_dit.schedule.choices import choose_attention_schedule

    ref = xstage.XStageParams.reference()
    kw = dict(batch=1, heads=24, head_dim=128, world_size=8, dtype_bytes=2)
    # Long sequence, fused kernel as fast as cuDNN: the design test holds and fused wins.
    c = choose_attention_schedule(ref, seq_len=32768, fused_over_cudnn=1.0, **kw)
    assert c.name == "fused" and c.params["rate_ok"] and c.params["capacity_ok"], c.reason
    # A gap shorter than G*: the rate bound fails and the reason says so.
    c = choose_attention_schedule(ref, seq_len=256, t_kv_tile_s=1e-7, **kw)
    assert c.name == "serial" and "rate bound fails" in c.reason
    # A slow drain (PCIe-like) with many producers overflows the stage: capacity bound fails.
    slow = xstage.XStageParams(num_producers=132, t_iss0_fixed_s=1e-6, issue_rate_Bps=5e12, drain_rate_Bps=55e9,
                               capacity_bytes=1e6)
    c = choose_attention_schedule(slow, seq_len=65536, **kw)
    assert c.name == "serial" and "capacity bound fails" in c.reason
    # Design test holds but a slow fused kernel costs more than the All-to-All it hides.
    c = choose_attention_schedule(ref, seq_len=65536, fused_over_cudnn=0.5, **kw)
    assert c.name == "serial" and "costs more" in c.reason
    # World size 1: nothing to hide.
    c = choose_attention_schedule(ref, seq_len=4608, batch=1, heads=24, head_dim=128, world_size=1, dtype_bytes=2)
    assert c.name == "serial" and "world size 1" in c.reason
    with pytest.raises(ValueError, match="seq_len"):
        choose_attention_schedule(ref, seq_len=0, **kw)


def test_schedule_auto_keeps_gpu_unvalidated_head_dims_on_serial():
    xstage = pytest.importorskip("xstage_dit.xstage")
    from xstage_dit.schedule.choices import FUSED_GPU_VALIDATED_HEAD_DIMS, choose_attention_schedule

    ref = xstage.XStageParams.reference()
    kw = dict(batch=1, heads=24, world_size=8, dtype_bytes=2, seq_len=32768, fused_over_cudnn=1.0)
    assert choose_attention_schedule(ref, head_dim=128, **kw).name == "fused"
    assert choose_attention_schedule(ref, head_dim=64, **kw).name == "fused"
    c = choose_attention_schedule(ref, head_dim=256, **kw)
    assert 256 not in FUSED_GPU_VALIDATED_HEAD_DIMS
    assert c.name == "serial" and "head_dim 256" in c.reason
