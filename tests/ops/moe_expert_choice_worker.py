"""Run under TRITON_INTERPRET=1 (spawned by tests/ops/test_moe_expert_choice.py): NucleusMoE's EP layer at
world 1 on the fused path (the Triton kernel in the interpreter) against diffusers' ``NucleusMoELayer``, the
host syncs of a forward, and the same layer under ``torch.compile(fullgraph=True)``. Prints one JSON line."""

from __future__ import annotations

import json
import math
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoELayer  # noqa: E402

import xstage_dit.features.ep_layers as ep_layers  # noqa: E402
from tests.helpers.host_syncs import count_host_syncs  # noqa: E402
from xstage_dit.ops.moe import MoEKernelConfig  # noqa: E402
from xstage_dit.schedule.facts import DeviceFacts  # noqa: E402

# The interpreter stands in for the GPU: the scheduler must see a CUDA device to pick the fused path
# (off CUDA it refuses "fused"). Four SMs: several waves at these shapes, so interleaved leads are real.
GPU = DeviceFacts(name="interpreted GPU", num_sms=4, l2_bytes=2**20, compute_capability=(9, 0), is_cuda=True)
ep_layers.DeviceFacts = type("InterpFacts", (), {"from_device": staticmethod(lambda device=None: GPU)})


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run_case(B, S, E, H, I, capacity_factor, lead, seed, dtype="float32", use_desc=False):
    # tl.dot on bf16 runs as raw uint16 in triton 3.6's interpreter: fp32 / fp16 here, bf16 on the GPU test.
    dtype = getattr(torch, dtype)
    torch.manual_seed(seed)
    layer = NucleusMoELayer(H, I, E, capacity_factor, False, 2.5, False).eval()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    layer = layer.to(dtype)
    cfg = MoEKernelConfig(16, 16, 16, 16, 4, 1, num_programs=3, lead=lead, use_desc=use_desc)
    ep = ep_layers.NucleusMoEEPLayer.from_layer(layer, None, path="fused", config=cfg)
    g = torch.Generator().manual_seed(seed + 1)
    x, u = (torch.randn(B, S, H, generator=g).to(dtype) for _ in range(2))
    t = torch.randn(B, H, generator=g).to(dtype)
    with torch.no_grad():
        ref = layer(x, u, t)
        out = ep(x, u, t)
        with count_host_syncs() as syncs:
            again = ep(x, u, t)
        torch._dynamo.reset()
        compiled = torch.compile(ep.forward, fullgraph=True, backend="eager", dynamic=False)(x, u, t)
    return {
        "rel": rel(out, ref),
        "repeat_max_abs": float((again - out).abs().max()),
        "compiled_max_abs": float((compiled - out).abs().max()),
        "syncs": [list(s) for s in syncs],
        "path": ep.schedule_choice.path,
        "lead": ep.schedule_choice.lead,
        "rows_per_expert": B * max(1, math.ceil(capacity_factor * S / E)),  # diffusers' capacity rule
    }


def opcheck_rows() -> str:
    """``torch.library.opcheck`` of the new op (schema, fake tensor, dispatch) at a tiny shape."""
    g = torch.Generator().manual_seed(0)
    E, R, H, I = 3, 5, 16, 16
    args = (torch.randn(E * R, H, generator=g), torch.randn(E, H, 2 * I, generator=g) * 0.2,
            torch.randn(E, I, H, generator=g) * 0.2, R, torch.rand(E * R, generator=g), 0, [])
    torch.library.opcheck(torch.ops.xstage_dit.moe_expert_mlp_rows.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    return "ok"


def main() -> int:
    cases = json.loads(sys.argv[1])
    results = [run_case(**c) for c in cases]
    print("RESULTS " + json.dumps({"cases": results, "opcheck": opcheck_rows()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
