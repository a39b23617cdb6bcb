"""The torch.compile work-around for diffusers' NucleusMoE grouped-matmul offsets (xstage_dit.features.compile_fixes)."""

from __future__ import annotations

import pytest
import torch

from xstage_dit.features.compile_fixes import fix_grouped_mm_offsets

moe = pytest.importorskip("diffusers.models.transformers.transformer_nucleusmoe_image")


def _layer(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layer = moe.NucleusMoELayer(hidden_size=64, moe_intermediate_dim=32, num_experts=4, capacity_factor=1.0,
                                use_sigmoid=False, route_scale=2.5, use_grouped_mm=True)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return layer.to(torch.bfloat16).eval()


def _inputs(seed: int = 1, seq: int = 24):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, seq, 64, generator=g).to(torch.bfloat16)
    u = torch.randn(2, seq, 64, generator=g).to(torch.bfloat16)
    t = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    return h, u, t


@torch.no_grad()
def test_fixed_layer_is_bit_identical_in_eager_and_undo_restores_the_method():
    layer = _layer()
    h, u, t = _inputs()
    ref = layer(h, u, t)
    undo, n = fix_grouped_mm_offsets(layer)
    assert n == 1 and "_run_experts_grouped_mm" in vars(layer.experts)
    assert torch.equal(layer(h, u, t), ref)  # same offsets, same grouped matmuls, same order
    undo()
    assert "_run_experts_grouped_mm" not in vars(layer.experts)
    assert torch.equal(layer(h, u, t), ref)


@torch.no_grad()
def test_fixed_layer_compiles_and_matches_eager():
    # diffusers' own path builds the offsets as cumsum(full(...), dtype=int32), which Inductor turns into
    # int64 (pytorch/pytorch#189518): torch.compile of the unfixed layer raises on the torch versions we pin.
    layer = _layer()
    h, u, t = _inputs(seq=40)  # an awkward length: capacity ceil(40 / 4) per expert
    eager = layer(h, u, t)
    fix_grouped_mm_offsets(layer)
    torch._dynamo.reset()
    compiled = torch.compile(layer)(h, u, t)
    torch.testing.assert_close(compiled.float(), eager.float(), atol=3e-2, rtol=3e-2)


def test_parallelize_installs_and_restore_removes_the_fix():
    from xstage_dit.families import load_pipeline
    from xstage_dit.features import ParallelConfig, parallelize

    pipe = load_pipeline("tiny-nucleusmoe", dtype=torch.float32, device="cpu", seed=0)
    experts = [m for m in pipe.transformer.modules() if type(m).__name__ == "SwiGLUExperts"]
    assert experts
    handle = parallelize(pipe, ParallelConfig(sp=1, ep=1, cfg=1, schedule="serial", calibrate=False))
    assert all("_run_experts_grouped_mm" in vars(m) for m in experts)
    handle.restore()
    assert not any("_run_experts_grouped_mm" in vars(m) for m in experts)
