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


def _hard_sync_barrier(self) -> None:
    """SymmetricBuffer.barrier with a full device synchronize + host barrier around the device barrier."""
    import torch.distributed as dist

    torch.cuda.synchronize()
    dist.barrier()
    if self.handle is not None:
        self.handle.barrier()
    torch.cuda.synchronize()


def _variants():
    """(name, path, lead or None, hard_sync)"""
    return [("reference", "reference", None, False), ("serial", "serial", None, False),
            ("fused", "fused", None, False), ("fused_hard_sync", "fused", None, True),
            ("fused_lead0", "fused", 0, False), ("fused_lead2", "fused", 2, False)]


def _case(rank, world, hidden, inter, experts, cf, batch, seq):
    import torch.distributed as dist

    from xstage_dit.comm import distributed as xdist
    from xstage_dit.ops.moe import combine as moe_combine
    from xstage_dit.ops.moe.combine import NucleusMoEEPLayer

    layer = _layer(hidden, inter, experts, cf)
    x, xu, t = _inputs(batch, seq, hidden)
    idx = torch.tensor_split(torch.arange(seq), world)[rank].cuda()
    res = {"shape": dict(hidden=hidden, inter=inter, experts=experts, cf=cf, batch=batch, seq=seq)}
    with torch.no_grad():
        diff = layer(x, xu, t)
        diff2 = layer(x, xu, t)
    res["diffusers_run_to_run"] = _rel(diff2, diff)
    outs = {}
    orig_barrier = xdist.SymmetricBuffer.barrier
    for name, path, lead, hard in _variants():
        r = {}
        try:
            cfg = moe_combine.MoEKernelConfig(lead=lead) if lead is not None else None
            xdist.SymmetricBuffer.barrier = _hard_sync_barrier if hard else orig_barrier
            one_layer = NucleusMoEEPLayer.from_layer(layer, None, path=path, config=cfg)
            one = one_layer(x, xu, t)
            one_b = one_layer(x, xu, t)
            routing_one = one_layer.last_routing["global_token_indices"].cpu()
            ep_layer = NucleusMoEEPLayer.from_layer(layer, dist.group.WORLD, path=path, config=cfg)
            ep = ep_layer(x[:, idx], xu[:, idx], t)
            ep_b = ep_layer(x[:, idx], xu[:, idx], t)
            torch.cuda.synchronize()
            routing_ep = ep_layer.last_routing["global_token_indices"].cpu()
            r.update({
                "one_run_to_run": _rel(one_b, one), "ep_run_to_run": _rel(ep_b, ep),
                "routing_identical": bool(torch.equal(routing_one, routing_ep)),
                "ep_vs_one": _rel(ep, one[:, idx]), "one_vs_diffusers": _rel(one, diff),
                "ep_vs_diffusers": _rel(ep, diff[:, idx]),
            })
            outs[name] = ep.float().cpu()
            # Which tokens differ (on the CPU: no device asserts), and how many experts chose them.
            e, o = ep.float().cpu(), one[:, idx].float().cpu()
            tok_err = (e - o).norm(dim=-1) / o.norm(dim=-1).clamp_min(1e-6)
            bad = tok_err > 2e-2
            r["tokens_over_2pct"] = f"{int(bad.sum())}/{bad.numel()}"
            if bad.any():
                chosen = torch.zeros(batch * seq, dtype=torch.int64)
                chosen.index_add_(0, routing_one.clamp(0, batch * seq - 1), torch.ones_like(routing_one))
                r["routing_index_range"] = [int(routing_one.min()), int(routing_one.max()), batch * seq]
                chosen = chosen.view(batch, seq)[:, idx.cpu()]
                r["bad_token_positions"] = bad.nonzero().tolist()[:12]
                r["bad_tokens_num_experts"] = chosen[bad].tolist()[:12]
                r["bad_token_err"] = [round(float(v), 4) for v in tok_err[bad][:12]]
                r["good_tokens_num_experts_mean"] = float(chosen[~bad].float().mean())
        except Exception:  # noqa: BLE001
            r["error"] = traceback.format_exc()[-1200:]
        finally:
            xdist.SymmetricBuffer.barrier = orig_barrier
        res[name] = r
        dist.barrier()
    if "fused" in outs and "reference" in outs:
        res["fused_vs_reference_ep"] = _rel(outs["fused"], outs["reference"])
    if "serial" in outs and "reference" in outs:
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
    from xstage_dit.comm.launcher import run_rank_processes

    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    results = run_rank_processes(_worker, 2, timeout_s=240)
    Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
