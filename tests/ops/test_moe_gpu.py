"""GPU tests of the fused expert MLP + remote combine: NucleusMoE and HiDream shapes against the fp32
reference (fresh random inputs, NaN-poisoned outputs, both schedules, virtual ranks), the EP layer
against diffusers on the GPU, and two processes sharing one GPU against one process."""

from __future__ import annotations

import os
import traceback

import pytest
import torch

from xstage_dit.comm.distributed import local_buffer_table
from xstage_dit.comm.launcher import run_rank_processes
from xstage_dit.ops.moe import (
    combine_reduce,
    combine_reduce_reference,
    expert_mlp_combine,
    expert_mlp_combine_reference,
)
from tests.helpers.tolerances import rel_err

pytestmark = pytest.mark.gpu

BF16_REL_TOL = 1e-2


def _case(rows_per_expert, hidden, inter, world, seed):
    """Rank 0's expert-major rows of a ``world``-rank EP layout, random router weights and destinations."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    El = len(rows_per_expert)
    rows = sum(rows_per_expert)
    x = torch.randn(rows, hidden, device="cuda", generator=g).to(torch.bfloat16)
    gate_up = (torch.randn(El, hidden, 2 * inter, device="cuda", generator=g) * hidden**-0.5).to(torch.bfloat16)
    down = (torch.randn(El, inter, hidden, device="cuda", generator=g) * inter**-0.5).to(torch.bfloat16)
    w = torch.rand(rows, device="cuda", generator=g) + 0.5
    dest_rank = torch.randint(0, world, (rows,), device="cuda", generator=g, dtype=torch.int32)
    dest_row = torch.empty(rows, dtype=torch.int32, device="cuda")
    for r in range(world):  # distinct slots per destination rank, shuffled
        sel = (dest_rank == r).nonzero().flatten()
        dest_row[sel] = torch.randperm(sel.numel(), device="cuda", generator=g).to(torch.int32)
    offsets = [0] + torch.tensor(rows_per_expert).cumsum(0).tolist()
    return x, gate_up, down, offsets, w, dest_rank, dest_row


def _check_fused(rows_per_expert, hidden, inter, world, lead, seed):
    x, gate_up, down, offsets, w, dest_rank, dest_row = _case(rows_per_expert, hidden, inter, world, seed)
    rows = x.shape[0]
    bufs = [torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(world)]
    refs = [torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(world)]
    sched = expert_mlp_combine(x, gate_up, down, offsets, w, dest_rank, dest_row, local_buffer_table(bufs), lead=lead)
    torch.cuda.synchronize()
    assert sched.lead == lead
    expert_mlp_combine_reference(x, gate_up, down, offsets, w, dest_rank, dest_row, refs)
    for r in range(world):
        n = int((dest_rank == r).sum())
        assert not torch.isnan(bufs[r][:n].float()).any(), f"rank {r}: unwritten combine rows"
        err = rel_err(bufs[r][:n], refs[r][:n])
        assert err < BF16_REL_TOL, f"rank {r} lead {lead}: rel err {err}"


@pytest.mark.parametrize("lead", [0, 2])
@pytest.mark.parametrize("world", [1, 4])
def test_fused_nucleus_shape(world, lead):
    # NucleusMoE: hidden 2048, 128 experts x 1344, capacity factor 8 over 4096 tokens = 256 rows per expert;
    # rank 0 of `world` holds 128/world experts.
    _check_fused([256] * (128 // world), 2048, 1344, world, lead, seed=world * 10 + lead)


@pytest.mark.parametrize("lead", [0, 1])
def test_fused_hidream_shape(lead):
    # HiDream: hidden 2560, 4 experts top-2 over 4096 tokens (8192 pairs, uneven), expert inner dim 6912.
    _check_fused([3001, 1499, 2900, 792], 2560, 6912, 2, lead, seed=7 + lead)


def test_combine_reduce_gpu():
    g = torch.Generator(device="cuda").manual_seed(3)
    tokens, hidden = 1000, 2048
    per_tok = torch.randint(0, 5, (tokens,), device="cuda", generator=g)
    offs = torch.zeros(tokens + 1, dtype=torch.int32, device="cuda")
    offs[1:] = per_tok.cumsum(0)
    n = int(offs[-1])
    slots = torch.randperm(n, device="cuda", generator=g).to(torch.int32)
    buf = torch.randn(n, hidden, device="cuda", generator=g).to(torch.bfloat16)
    shared = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    assert rel_err(combine_reduce(buf, offs, slots, shared), combine_reduce_reference(buf, offs, slots, shared)) < 1e-2


def _nucleus_layer(hidden=256, inter=192, experts=16, cf=4.0):
    from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoELayer

    torch.manual_seed(0)
    layer = NucleusMoELayer(hidden, inter, experts, cf, False, 2.5, True)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=hidden**-0.5)
    return layer.to("cuda", torch.bfloat16).eval()


def _inputs(batch=2, seq=300, hidden=256):
    g = torch.Generator().manual_seed(11)
    mk = lambda *s: torch.randn(*s, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
    return mk(batch, seq, hidden), mk(batch, seq, hidden), mk(batch, hidden)


def test_ep_layer_fused_world1_matches_diffusers():
    pytest.importorskip("diffusers")
    from xstage_dit.features.ep_layers import NucleusMoEEPLayer

    layer = _nucleus_layer()
    x, xu, t = _inputs()
    with torch.no_grad():
        ref = layer(x, xu, t)
    ep = NucleusMoEEPLayer.from_layer(layer, None, path="fused")
    assert rel_err(ep(x, xu, t), ref) < BF16_REL_TOL


def _shared_gpu_worker(rank, world, port, queue):
    try:
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        import torch.distributed as dist

        from xstage_dit.features.ep_layers import HiDreamMoEEPLayer, NucleusMoEEPLayer

        torch.cuda.set_device(0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        # The one-process reference runs on a group of this rank alone: group=None would mean the default
        # (two-rank) group here, i.e. both ranks feeding the whole sequence as two shards of a doubled one.
        solo = [dist.new_group([r]) for r in range(world)][rank]
        layer = _nucleus_layer()
        x, xu, t = _inputs()
        one = NucleusMoEEPLayer.from_layer(layer, solo, path="fused")(x, xu, t)  # one process, whole sequence
        with torch.no_grad():
            ref = layer(x, xu, t)  # diffusers' own layer on the whole sequence
        ep = NucleusMoEEPLayer.from_layer(layer, dist.group.WORLD, path="fused")
        idx = torch.tensor_split(torch.arange(x.shape[1]), world)[rank].cuda()
        y = ep(x[:, idx], xu[:, idx], t)
        res = {"nucleus_rel": rel_err(y, one[:, idx]), "nucleus_vs_diffusers": rel_err(y, ref[:, idx])}

        from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

        torch.manual_seed(1)
        hd = MOEFeedForwardSwiGLU(256, 512, 4, 2)
        for p in hd.parameters():
            torch.nn.init.normal_(p, std=256**-0.5)
        hd = hd.to("cuda", torch.bfloat16).eval()
        one = HiDreamMoEEPLayer.from_layer(hd, solo, path="fused")(x)
        y = HiDreamMoEEPLayer.from_layer(hd, dist.group.WORLD, path="fused")(x[:, idx])
        res["hidream_rel"] = rel_err(y, one[:, idx])
        dist.barrier()
        queue.put((rank, res))
    except Exception:  # noqa: BLE001
        queue.put((rank, traceback.format_exc()))


def test_two_processes_sharing_one_gpu_match_one_process():
    pytest.importorskip("diffusers")
    # Both ranks map buffers of the same GPU; set before the children import torch.
    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    results = run_rank_processes(_shared_gpu_worker, 2, timeout_s=180)
    for rank, res in results.items():
        assert not isinstance(res, str), f"rank {rank} failed:\n{res}"
        assert res["nucleus_rel"] < BF16_REL_TOL and res["hidream_rel"] < BF16_REL_TOL, res
        assert res["nucleus_vs_diffusers"] < BF16_REL_TOL, res
