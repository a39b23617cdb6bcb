"""CPU checks of the public Ulysses attention API: reference, serial path at world 1, validation
messages, the custom op (opcheck, fake tensors), and what "auto" resolves to (the chooser itself is
tested in tests/schedule)."""

from __future__ import annotations

import math

import pytest
import torch

from xstage_dit.ops.attention import (attention_reference, head_split, resolve_attention_schedule, shard_bounds,
                                     ulysses_attention, ulysses_attention_reference)
from xstage_dit.schedule.facts import DeviceFacts
from xstage_dit.xstage import XStageParams


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


@pytest.mark.parametrize("schedule, xparams", [("serial", None), ("auto", None), ("auto", XStageParams.reference())])
def test_compile_traces_the_op(schedule, xparams):
    # "auto" resolves at trace time (the same function eager calls), so the graph holds the op and nothing else
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 12, 2, 16) for _ in range(3))
    fn = torch.compile(lambda a, b, c: ulysses_attention(a * 2.0, b, c, schedule=schedule, xparams=xparams),
                       backend="eager", fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), attention_reference(q * 2.0, k, v), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------- "auto" resolution


def test_auto_on_cpu_resolves_to_serial_and_says_why():
    kw = dict(batch=1, seq_len=8, heads=2, head_dim=16, world_size=2, device="cpu")
    c = resolve_attention_schedule(XStageParams.reference(), dtype=torch.float32, **kw)
    assert c.name == "serial" and "float16 or bfloat16" in c.reason
    c = resolve_attention_schedule(XStageParams.reference(), dtype=torch.bfloat16, **kw)
    assert c.name == "serial" and "CUDA" in c.reason


def test_auto_on_a_gpu_shape_goes_through_the_design_test():
    # A CUDA device type with the device's facts handed in: no GPU is touched, the chooser decides.
    facts = DeviceFacts("H200", 132, 60 * 2**20, (9, 0), True)
    kw = dict(batch=1, heads=24, head_dim=128, dtype=torch.bfloat16, device="cuda:0", facts=facts)
    assert resolve_attention_schedule(None, seq_len=32768, world_size=8, **kw).reason.startswith("no X-Stage")
    c = resolve_attention_schedule(XStageParams.reference(), seq_len=32768, world_size=1, **kw)
    assert c.name == "serial" and "world size 1" in c.reason


def test_op_refuses_auto_inside_the_custom_op():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="resolve 'auto' before the op"):
        torch.ops.xstage_dit.ulysses_attention(q, q, q, "", "auto", None, None)
