#!/usr/bin/env python3
"""GPU diagnosis: where does the NucleusMoE EP layer over two processes sharing one GPU differ from
one process? (tests/test_moe_gpu.py::test_two_processes_sharing_one_gpu_match_one_process)

Each rank runs the layer at world 1 (whole sequence) and at world 2 (its shard) for every path
(reference / serial / fused), twice each, and reports: run-to-run differences (determinism), the
routing decisions (identical or not), world-2 vs world-1 per path, and which tokens differ (routed
to a local or a remote expert, how many experts chose them).

    python benchmarks/diag_moe_two_procs.py --out diag_moe.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _layer(hidden, inter, experts, cf):
    from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoELayer

    torch.manual_seed(0)
    layer = NucleusMoELayer(hidden, inter, experts, cf, False, 2.5, True)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=hidden**-0.5)
    return layer.to("cuda", torch.bfloat16).eval()


def _inputs(batch, seq, hidden):
    g = torch.Generator().manual_seed(11)
    mk = lambda *s: torch.randn(*s, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
    return mk(batch, seq, hidden), mk(batch, seq, hidden), mk(batch, hidden)


def _case(rank, world, hidden, inter, experts, cf, batch, seq):
    import torch.distributed as dist

    from xstage_dit.ops.moe_combine import NucleusMoEEPLayer

    layer = _layer(hidden, inter, experts, cf)
    x, xu, t = _inputs(batch, seq, hidden)
    idx = torch.tensor_split(torch.arange(seq), world)[rank].cuda()
    res = {"shape": dict(hidden=hidden, inter=inter, experts=experts, cf=cf, batch=batch, seq=seq)}
    with torch.no_grad():
        diff = layer(x, xu, t)
        diff2 = layer(x, xu, t)
    res["diffusers_run_to_run"] = _rel(diff2, diff)
    outs = {}
    for path in ("reference", "serial", "fused"):
        one_layer = NucleusMoEEPLayer.from_layer(layer, None, path=path)
        one = one_layer(x, xu, t)
        one_b = one_layer(x, xu, t)
        routing_one = one_layer.last_routing["global_token_indices"].clone()
        ep_layer = NucleusMoEEPLayer.from_layer(layer, dist.group.WORLD, path=path)
        ep = ep_layer(x[:, idx], xu[:, idx], t)
        ep_b = ep_layer(x[:, idx], xu[:, idx], t)
        routing_ep = ep_layer.last_routing["global_token_indices"]
        r = {
            "one_run_to_run": _rel(one_b, one), "ep_run_to_run": _rel(ep_b, ep),
            "routing_identical": bool(torch.equal(routing_one, routing_ep)),
            "ep_vs_one": _rel(ep, one[:, idx]), "one_vs_diffusers": _rel(one, diff),
            "ep_vs_diffusers": _rel(ep, diff[:, idx]),
        }
        # Which tokens differ: per-token relative error, and how many experts chose each token.
        tok_err = ((ep.float() - one[:, idx].float()).norm(dim=-1) / one[:, idx].float().norm(dim=-1).clamp_min(1e-6))
        bad = tok_err > 2e-2
        r["tokens_over_2pct"] = f"{int(bad.sum())}/{bad.numel()}"
        if bad.any():
            chosen = torch.zeros(batch * seq, dtype=torch.int64, device="cuda")
            chosen.scatter_add_(0, routing_one, torch.ones_like(routing_one))
            chosen = chosen.view(batch, seq)[:, idx]
            r["bad_token_positions"] = bad.nonzero().tolist()[:12]
            r["bad_tokens_num_experts"] = chosen[bad].tolist()[:12]
            r["bad_token_err"] = [round(float(e), 4) for e in tok_err[bad][:12]]
            r["good_tokens_num_experts_mean"] = float(chosen[~bad].float().mean())
        outs[path] = ep
        res[path] = r
    res["fused_vs_reference_ep"] = _rel(outs["fused"], outs["reference"])
    res["serial_vs_reference_ep"] = _rel(outs["serial"], outs["reference"])
    return res


def _worker(rank, world, port, queue):
    try:
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        import torch.distributed as dist

        torch.cuda.set_device(0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        results = []
        for shape in [(256, 192, 16, 4.0, 2, 300), (256, 192, 16, 4.0, 1, 256), (2048, 1344, 128, 8.0, 1, 1024)]:
            try:
                results.append(_case(rank, world, *shape))
            except Exception:  # noqa: BLE001
                results.append({"shape": shape, "error": traceback.format_exc()[-1500:]})
            dist.barrier()
        queue.put((rank, results))
    except Exception:  # noqa: BLE001
        queue.put((rank, traceback.format_exc()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="diag_moe.json")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    from xstage_dit.launch import free_port

    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(2):
            rank, res = queue.get(timeout=240)
            results[rank] = res
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
