"""Benchmark: the EP MoE layers on real ranks (one GPU each): serial vs fused (wave) vs fused interleaved.

Launch one process per GPU::

    torchrun --nproc-per-node 8 benchmarks/bench_moe_ep.py --out benchmarks/results/moe-ep-h200x8

Each rank holds E/P experts and its contiguous shard of the 4096-token sequence. Variants (same inputs,
same layer, one run): ``serial`` = library All-to-All (NCCL) both ways around the unfused grouped-matmul
MLP (``path="serial"``); ``fused/wave`` and ``fused/D=n`` = push dispatch + persistent kernel with the
combine stored remotely from the Linear-2 epilogue (``path="fused"``). Each timing: barrier, CUDA events
around one forward, the max over ranks; the median of ``--iters`` after ``--warmup``.
Writes ``<out>.json`` (top-level ``summary.speedup_over_serial`` keyed by GPU count) and ``<out>.md``
on rank 0. ``--tiny`` runs small shapes (also on CPU with gloo, ``--paths reference``: a plumbing check).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_moe_combine import env_info  # noqa: E402

from xstage_dit.comm.distributed import init_distributed  # noqa: E402
from xstage_dit.ops.moe import MoEKernelConfig  # noqa: E402
from xstage_dit.features.ep_layers import HiDreamMoEEPLayer, NucleusMoEEPLayer  # noqa: E402


def build(model: str, tiny: bool, device, dtype):
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU
    from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoELayer

    torch.manual_seed(0)
    if model == "nucleusmoe":
        h, inter, e = (64, 48, 8) if tiny else (2048, 1344, 128)
        layer = NucleusMoELayer(h, inter, e, 8.0, False, 2.5, True)
    else:
        h, e = (64, 4) if tiny else (2560, 4)
        layer = MOEFeedForwardSwiGLU(h, 4 * h, e, 2)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=h**-0.5)
    return layer.to(device, dtype).eval(), h


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/moe-ep")
    ap.add_argument("--models", default="nucleusmoe,hidream")
    ap.add_argument("--paths", default="serial,wave,1,2,3", help="serial | reference | wave | a lead D")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    info = init_distributed()
    rank, world, device = info.rank, info.world_size, info.device
    group = dist.group.WORLD if world > 1 else None
    cuda = device.type == "cuda"
    dtype = torch.bfloat16
    rows = []
    for model in args.models.split(","):
        layer, h = build(model, args.tiny, device, dtype)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(1, args.tokens, h, generator=g).to(device, dtype)
        t = torch.randn(1, h, generator=g).to(device, dtype)
        idx = torch.tensor_split(torch.arange(args.tokens), world)[rank].to(device)
        xs = x[:, idx].contiguous()
        base = None
        for variant in args.paths.split(","):
            if variant in ("serial", "reference"):
                kw = {"path": variant}
            else:
                lead = 0 if variant == "wave" else int(variant)
                kw = {"path": "fused", "config": MoEKernelConfig(lead=lead)}
            cls = NucleusMoEEPLayer if model == "nucleusmoe" else HiDreamMoEEPLayer
            ep = cls.from_layer(layer, group, **kw)
            run = (lambda: ep(xs, xs, t)) if model == "nucleusmoe" else (lambda: ep(xs))
            out = run()
            if base is None:
                base = out
            rel = float((out.float() - base.float()).norm() / base.float().norm())
            times = []
            for i in range(args.warmup + args.iters):
                if world > 1:
                    dist.barrier()
                if cuda:
                    torch.cuda.synchronize()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    run()
                    b.record()
                    b.synchronize()
                    ms = a.elapsed_time(b)
                else:
                    t0 = time.perf_counter()
                    run()
                    ms = (time.perf_counter() - t0) * 1e3
                m = torch.tensor([ms], dtype=torch.float64, device=device if cuda else "cpu")
                if world > 1:
                    dist.all_reduce(m, op=dist.ReduceOp.MAX)
                if i >= args.warmup:
                    times.append(float(m.item()))
            rows.append({"model": model, "gpus": world, "variant": variant, "ms": statistics.median(times),
                         "rel_diff_vs_first": rel})  # fmt: skip
            if rank == 0:
                print(f"{model:10s} P={world} {variant:8s} {rows[-1]['ms']:.4f} ms  rel diff {rel:.2e}", flush=True)
            del ep
    if rank == 0:
        summary = {"speedup_over_serial": {}, "interleaved_over_wave": {}}
        for model in args.models.split(","):
            rs = {r["variant"]: r["ms"] for r in rows if r["model"] == model}
            fused = {k: v for k, v in rs.items() if k not in ("serial", "reference")}
            if "serial" in rs and fused:
                best = min(fused, key=fused.get)
                summary["speedup_over_serial"].setdefault(str(world), {})[model] = {
                    "best": best, "ratio": rs["serial"] / fused[best]}
            inter = {k: v for k, v in fused.items() if k != "wave"}
            if "wave" in fused and inter:
                d = min(inter, key=inter.get)
                summary["interleaved_over_wave"].setdefault(str(world), {})[model] = {
                    "best_lead": int(d), "ratio": fused["wave"] / inter[d]}
        env = env_info() if cuda else {"device": "cpu", "torch": torch.__version__}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps({"env": env, "summary": summary, "results": rows}, indent=1))
        md = [f"# EP MoE layers on {world} x {env.get('gpu', 'cpu')}", "", "| model | GPUs | variant | ms | vs serial |",
              "|---|---|---|---|---|"]  # fmt: skip
        for r in rows:
            ser = next((q["ms"] for q in rows if q["model"] == r["model"] and q["variant"] == "serial"), None)
            md.append(f"| {r['model']} | {r['gpus']} | {r['variant']} | {r['ms']:.4f} | "
                      f"{(ser / r['ms']) if ser else float('nan'):.2f}x |")  # fmt: skip
        md += ["", "```json", json.dumps(summary, indent=1), "```", ""]
        out.with_suffix(".md").write_text("\n".join(md))
        print(json.dumps(summary, indent=1))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
