"""GPU tests of `parallelize` (marked `gpu`: skipped, and counted, without a CUDA device).

A FLUX.1-architecture transformer (4 heads x 64, 2+2 blocks, bf16, random weights) at 512 image + 64 text
tokens: world 1 with the fused and the serial schedule against plain diffusers, and sp=2 as two processes
sharing the GPU (gloo control, symmetric-memory data) against world 1. Run as a script, this file is the
2-rank worker: ``python tests/test_parallelize_gpu.py OUT.pt SCHEDULE``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from tests.helpers.tolerances import rel_err

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CFG = dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=64,
           num_attention_heads=4, joint_attention_dim=256, pooled_projection_dim=128, guidance_embeds=True,
           axes_dims_rope=(16, 24, 24))
IMG, TXT = 512, 64


def _model_and_inputs(device):
    from diffusers import FluxTransformer2DModel

    from xstage_dit.families.build import build_module

    model = build_module(lambda: FluxTransformer2DModel(**CFG), seed=0, device=device, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    x = dict(hidden_states=torch.randn(1, IMG, 64, generator=g), encoder_hidden_states=torch.randn(1, TXT, 256, generator=g),
             pooled_projections=torch.randn(1, 128, generator=g), timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]))
    x = {k: v.to(device, torch.bfloat16) for k, v in x.items()}
    ids = torch.zeros(IMG, 3)
    ids[:, 1] = torch.arange(IMG) // 32
    ids[:, 2] = torch.arange(IMG) % 32
    x.update(img_ids=ids.to(device), txt_ids=torch.zeros(TXT, 3, device=device), return_dict=False)
    return model, x


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["fused", "serial"])
def test_world1_matches_plain_diffusers(schedule):
    from xstage_dit.features import ParallelConfig, parallelize

    model, x = _model_and_inputs(torch.device("cuda"))
    with torch.no_grad():
        ref = model(**x)[0]
        path = "ulysses" if schedule == "fused" else "local"  # world-1 serial = diffusers' own SDPA call
        with parallelize(model, ParallelConfig(schedule=schedule, calibrate=False)) as handle:
            out = model(**x)[0]
        assert path in handle.attention_paths, handle.attention_paths
        back = model(**x)[0]
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 2e-2, rel_err(out, ref)  # bf16 attention, different kernels
    assert torch.equal(back, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["fused"])
def test_two_ranks_sharing_the_gpu_match_world1(schedule, tmp_path):
    from xstage_dit.comm.launcher import launch
    from xstage_dit.features import ParallelConfig, parallelize

    model, x = _model_and_inputs(torch.device("cuda"))
    with torch.no_grad(), parallelize(model, ParallelConfig(schedule=schedule, calibrate=False)):
        ref = model(**x)[0].float().cpu()
    del model
    torch.cuda.empty_cache()
    out_path = tmp_path / "w2.pt"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = launch(2, [sys.executable, __file__, str(out_path), schedule], timeout_s=240, env=env)
    assert code == 0
    out = torch.load(out_path)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 2e-2, rel_err(out, ref)


def _rank_worker(out_path: str, schedule: str) -> int:
    from xstage_dit.comm.distributed import init_distributed
    from xstage_dit.features import ParallelConfig, parallelize

    info = init_distributed(timeout_s=120)
    model, x = _model_and_inputs(info.device)
    with torch.no_grad(), parallelize(model, ParallelConfig(sp=info.world_size, schedule=schedule,
                                                            calibrate=False)) as handle:
        out = model(**x)[0]
        assert "ulysses" in handle.attention_paths, handle.attention_paths
    if info.rank == 0:
        torch.save(out.float().cpu(), out_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(_rank_worker(sys.argv[1], sys.argv[2]))
