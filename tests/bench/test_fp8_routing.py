"""benchmarks/_fp8_routing.py: the picks it records are the tokens diffusers' NucleusMoELayer sent to its experts,
and the agreement counts the picks two runs share."""

from __future__ import annotations

import pytest
import torch

from benchmarks._fp8_routing import agreement, expert_choice_layers, recorded_picks

moe = pytest.importorskip("diffusers.models.transformers.transformer_nucleusmoe_image")


@pytest.mark.parametrize("use_sigmoid,dtype", [(False, torch.bfloat16), (True, torch.float32)])
@torch.no_grad()
def test_the_recorded_picks_are_the_tokens_the_experts_got(use_sigmoid, dtype):
    torch.manual_seed(0)
    layer = moe.NucleusMoELayer(hidden_size=64, moe_intermediate_dim=32, num_experts=4, capacity_factor=1.5,
                                use_sigmoid=use_sigmoid, route_scale=2.5, use_grouped_mm=False).to(dtype).eval()
    model = torch.nn.ModuleList([layer])
    seen = []
    layer.experts.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
    h, u, t = (torch.randn(2, 37, 64, dtype=dtype), torch.randn(2, 37, 64, dtype=dtype),
               torch.randn(2, 64, dtype=dtype))  # 37 tokens: capacity ceil(1.5 * 37 / 4) = 14
    assert expert_choice_layers(model) == [layer]
    with recorded_picks(model) as picks:
        layer(h, u, t)
    (chosen, tokens), = picks
    assert chosen.shape == (2, 4, 14) and tokens == 37
    # diffusers gathers expert-major: expert e's picks of sample 0, then of sample 1
    flat = (chosen.long() + torch.arange(2).view(2, 1, 1) * 37).transpose(0, 1).reshape(-1)
    assert torch.equal(seen[0], h.reshape(-1, 64)[flat])
    assert agreement(picks, picks) == 1.0
    with recorded_picks(model) as none_after:
        pass
    assert none_after == []


def test_agreement_counts_shared_picks_and_refuses_calls_that_do_not_pair():
    a = [(torch.tensor([[[0, 1], [2, 3]]], dtype=torch.int32), 5)]
    b = [(torch.tensor([[[1, 4], [3, 2]]], dtype=torch.int32), 5)]  # expert 0 shares token 1; expert 1 both
    assert agreement(a, b) == pytest.approx(3 / 4)
    assert agreement(a, []) is None and agreement([], a) is None
    assert agreement(a, [(b[0][0], 6)]) is None
