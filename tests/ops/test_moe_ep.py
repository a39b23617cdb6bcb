"""EP layers (NucleusMoE expert-choice, HiDream top-k) at world 1, 2 and 4 over gloo against the original
diffusers layer on the full sequence: routing decisions bit-exact, outputs within bf16 tolerance."""

from __future__ import annotations

import traceback
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from xstage_dit.comm.launcher import run_rank_processes
from xstage_dit.features.ep_layers import HiDreamMoEEPLayer, NucleusMoEEPLayer
from tests.helpers.tolerances import rel_err

BF16_REL_TOL = 2e-2


def _nucleus(hidden=32, inter=24, experts=8, cf=2.0, use_sigmoid=False, seed=0):
    from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoELayer

    torch.manual_seed(seed)
    layer = NucleusMoELayer(hidden, inter, experts, cf, use_sigmoid, 2.5, False)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=hidden**-0.5)
    return layer.to(torch.bfloat16).eval()


def _hidream(hidden=32, experts=4, top_k=2, seed=0):
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    torch.manual_seed(seed)
    layer = MOEFeedForwardSwiGLU(hidden, 2 * hidden, experts, top_k)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=hidden**-0.5)
    return layer.to(torch.bfloat16).eval()


@contextmanager
def _record_topk(store: list):
    real = torch.topk

    def spy(*args, **kwargs):
        res = real(*args, **kwargs)
        store.append(res.indices.clone())
        return res

    with mock.patch.object(torch, "topk", spy):
        yield


def _inputs(batch, seq, hidden, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, hidden, generator=g).to(torch.bfloat16)
    xu = torch.randn(batch, seq, hidden, generator=g).to(torch.bfloat16)
    t = torch.randn(batch, hidden, generator=g).to(torch.bfloat16)
    return x, xu, t


def _check_rank(rank: int, world: int, group) -> dict:
    """Both layers on this rank's shard of an uneven sequence split; returns the measured errors."""
    out = {}
    for name, seq, kw, router in (("nucleus", 23, {}, "exact"), ("nucleus_sigmoid_b1", 17, {"use_sigmoid": True}, "exact"),
                                  ("nucleus_scores", 23, {}, "scores")):  # fmt: skip
        layer = _nucleus(**kw)
        batch = 1 if name == "nucleus_sigmoid_b1" else 2
        x, xu, t = _inputs(batch, seq, 32, seed=7)
        rec: list = []
        with _record_topk(rec), torch.no_grad():
            ref = layer(x, xu, t)
        ep = NucleusMoEEPLayer.from_layer(layer, group, router=router)
        assert ep.gate_up_proj.shape[0] == 8 // world
        shards = torch.tensor_split(torch.arange(seq), world)
        idx = shards[rank]
        rec_ep: list = []
        with _record_topk(rec_ep):
            y = ep(x[:, idx], xu[:, idx], t)
        out[f"{name}_rel"] = rel_err(y, ref[:, idx])
        out[f"{name}_routing_equal"] = bool(torch.equal(rec[0], rec_ep[0]))
        if world > 1:
            back = ep.to_layer()
            with torch.no_grad():
                out[f"{name}_to_layer_equal"] = bool(torch.equal(back(x, xu, t), ref))

    # NucleusMoE with a shard holding no tokens (3 tokens over up to 4 ranks).
    layer = _nucleus()
    x3, xu3, t3 = _inputs(1, 3, 32, seed=12)
    with torch.no_grad():
        ref3 = layer(x3, xu3, t3)
    idx3 = torch.tensor_split(torch.arange(3), world)[rank]
    y3 = NucleusMoEEPLayer.from_layer(layer, group)(x3[:, idx3], xu3[:, idx3], t3)
    out["nucleus_tiny_shape_ok"] = tuple(y3.shape) == (1, len(idx3), 32)
    if len(idx3):
        out["nucleus_tiny_rel"] = rel_err(y3, ref3[:, idx3])

    layer = _hidream()
    x, _, _ = _inputs(3, 11, 32, seed=9)
    with torch.no_grad():
        ref = layer(x)
        ref_idx, _, _ = layer.gate(x)
    ep = HiDreamMoEEPLayer.from_layer(layer, group)
    assert ep.gate_up.shape[0] == 4 // world
    idx = torch.tensor_split(torch.arange(11), world)[rank]
    routed: list = []  # the EP layer's routing, seen at its gate's output
    hook = ep.gate.register_forward_hook(lambda module, args, output: routed.append(output[0].clone()))
    y = ep(x[:, idx])
    hook.remove()
    out["hidream_rel"] = rel_err(y, ref[:, idx])
    got = routed[0].reshape(3, len(idx), -1)
    # A shard with no tokens at all (3 tokens over 4 ranks) must still take part in every collective.
    x3, _, _ = _inputs(1, 3, 32, seed=10)
    with torch.no_grad():
        ref3 = layer(x3)
    idx3 = torch.tensor_split(torch.arange(3), world)[rank]
    y3 = ep(x3[:, idx3])
    out["hidream_tiny_shape_ok"] = tuple(y3.shape) == (1, len(idx3), 32)
    if len(idx3):
        out["hidream_tiny_rel"] = rel_err(y3, ref3[:, idx3])
    out["hidream_serial_rel"] = rel_err(HiDreamMoEEPLayer.from_layer(layer, group, path="serial")(x[:, idx]), ref[:, idx])
    out["hidream_routing_equal"] = bool(torch.equal(got.sort(-1).values, ref_idx.reshape(3, 11, -1)[:, idx].sort(-1).values))
    return out


def _worker(rank, world, port, queue):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        res = _check_rank(rank, world, dist.group.WORLD)
        dist.barrier()
        queue.put((rank, res))
    except Exception:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_world(world: int, timeout_s: float = 60.0) -> list[dict]:
    # fork: no re-import of torch/diffusers per rank (CI time)
    results = run_rank_processes(_worker, world, start_method="fork", timeout_s=timeout_s, join_s=5)
    for rank, res in results.items():
        assert not isinstance(res, str), f"rank {rank} failed:\n{res}"
    return [results[r] for r in range(world)]


def _assert_results(results):
    for r, res in enumerate(results):
        for key, v in res.items():
            if key.endswith("_rel"):
                assert v < BF16_REL_TOL, f"rank {r}: {key} = {v}"
            else:
                assert v is True, f"rank {r}: {key} = {v}"


def test_ep_layers_world1():
    _assert_results([_check_rank(0, 1, None)])


@pytest.mark.parametrize("world", [2, 4])
def test_ep_layers_gloo(world):
    _assert_results(_run_world(world))


def test_ep_layer_rejects_indivisible_experts():
    layer = _nucleus(experts=8)

    class FakeGroup:
        pass

    with mock.patch("xstage_dit.features.ep_layers.world_of", return_value=(0, 3)):
        with pytest.raises(ValueError, match="num_experts=8, world_size=3"):
            NucleusMoEEPLayer.from_layer(layer, FakeGroup())


def test_ep_layer_rejects_unknown_path():
    with pytest.raises(ValueError, match="expected path in .*got 'fast'"):
        HiDreamMoEEPLayer.from_layer(_hidream(), None, path="fast")


def test_from_layer_rejects_other_modules():
    with pytest.raises(TypeError, match="NucleusMoELayer"):
        NucleusMoEEPLayer.from_layer(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="MOEFeedForwardSwiGLU"):
        HiDreamMoEEPLayer.from_layer(torch.nn.Linear(2, 2))


def test_schedule_is_chosen_once_per_shape_logged_and_on_the_layer(caplog):
    """World 1 on the CPU: the scheduler picks the reference path, says why once per shape, and the layer
    shows the decision; a new token count is a new shape (and a new line)."""
    from xstage_dit.schedule.moe import MoEScheduler

    layer = _nucleus()
    scheduler = MoEScheduler()
    ep = NucleusMoEEPLayer.from_layer(layer, None, scheduler=scheduler)
    assert ep.schedule_choice is None
    x, xu, t = _inputs(2, 23, 32, seed=7)
    with caplog.at_level("INFO", logger="xstage_dit.schedule.moe"):
        ep(x, xu, t)
        ep(x, xu, t)
        lines = [r.getMessage() for r in caplog.records if "EP MoE schedule" in r.getMessage()]
        assert len(lines) == 1 and "reference" in lines[0] and "no GPU (cpu)" in lines[0], lines
        assert ep.schedule_choice.path == "reference" and "no GPU" in ep.schedule_choice.reason
        ep(x[:, :11], xu[:, :11], t)
        lines = [r.getMessage() for r in caplog.records if "EP MoE schedule" in r.getMessage()]
    assert len(lines) == 2 and len(scheduler.choices) == 2
    # A second layer of the same shape on the same scheduler reuses the decision: no new line.
    other = NucleusMoEEPLayer.from_layer(layer, None, scheduler=scheduler)
    with caplog.at_level("INFO", logger="xstage_dit.schedule.moe"):
        other(x, xu, t)
    assert len([r for r in caplog.records if "EP MoE schedule" in r.getMessage()]) == 2
    assert other.schedule_choice is scheduler.choices[next(iter(scheduler.choices))]


def test_explicit_fused_path_on_the_cpu_is_refused():
    ep = HiDreamMoEEPLayer.from_layer(_hidream(), None, path="fused")
    with pytest.raises(RuntimeError, match="path='fused' needs CUDA tensors, got cpu"):
        ep(torch.randn(1, 3, 32).to(torch.bfloat16))


def test_ep_moe_forward_takes_only_a_chosen_path():
    from xstage_dit.ops.moe import ep_moe_forward

    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match=r"expected path in \('fused', 'serial', 'reference'\).*got 'auto'"):
        ep_moe_forward(x, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0),
                       torch.zeros(1, 8, 4), torch.zeros(1, 2, 8), None, num_experts=1, path="auto", lead=0)
