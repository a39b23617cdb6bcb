"""Benchmark: expert MLP + combine at the NucleusMoE and HiDream shapes on one GPU (virtual ranks).

Rows (each a median of CUDA-event timings after warm-up, ``triton.testing.do_bench``, one run):

- ``diffusers``: diffusers' own layer (whole layer: router, shared expert, experts; P = 1 only);
- ``bmm``: cuBLAS bmm Linear-1 + Linear-2 only (equal expert sizes: NucleusMoE) - a GEMM ceiling;
- ``reference``: our unfused path: ``F.grouped_mm`` Linear-1, SwiGLU pass, ``F.grouped_mm`` Linear-2,
  router weighting (one bf16 pass), scatter into the combine buffers (``expert_mlp_combine_grouped``);
- ``fused/wave``: persistent Triton kernel, wave-by-wave schedule (lead 0);
- ``fused/D=n``: interleaved schedule with lead n.

Config names: ``m{block_m}n{block_n1}n{block_n2}k{block_k}w{warps}s{stages}``; ``-static``: static tile
stride instead of the atomic ticket; ``-desc``: TMA tensor-descriptor loads (``use_desc``).

With ``P`` virtual ranks, rank 0 holds ``E/P`` experts and all their rows (what one GPU of a P-GPU
node runs); its combine rows go to ``P`` buffers (here all in local HBM) through a pointer table.
TFLOP/s count the expert MLP only: ``6 * rows * hidden * inter``.

Usage: ``python benchmarks/bench_moe_combine.py --out benchmarks/results/moe-combine-h200``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xstage_dit.comm.distributed import local_buffer_table  # noqa: E402
from xstage_dit.ops.moe import MoEKernelConfig, expert_mlp_combine, expert_mlp_combine_grouped  # noqa: E402

SHAPES = {
    # diffusers NucleusMoE-Image MoE layer: hidden 2048, 128 experts x 1344, capacity factor 8, 4096 tokens.
    "nucleusmoe": dict(hidden=2048, inter=1344, experts=128, tokens=4096, capacity_factor=8.0, top_k=None),
    # diffusers HiDream-I1 MoE feed-forward: hidden 2560, 4 experts (inner 6912) top-2, 4096 tokens.
    "hidream": dict(hidden=2560, inter=6912, experts=4, tokens=4096, capacity_factor=None, top_k=2),
}

DEVICE = "cuda"  # the CPU smoke test of this script sets "cpu" and float16 (with TRITON_INTERPRET=1)
DTYPE = torch.bfloat16

CONFIGS = {
    # Pointer (cp.async) loads, use_desc=False: the default config takes TMA descriptors where it can.
    "m128n64n128k64w8s3": MoEKernelConfig(128, 64, 128, 64, 8, 3, use_desc=False),
    "m128n64n256k64w8s3": MoEKernelConfig(128, 64, 256, 64, 8, 3, use_desc=False),
    "m128n128n128k64w8s3": MoEKernelConfig(128, 128, 128, 64, 8, 3, use_desc=False),
    "m128n64n128k64w4s4": MoEKernelConfig(128, 64, 128, 64, 4, 4, use_desc=False),
    "m64n64n128k64w4s4": MoEKernelConfig(64, 64, 128, 64, 4, 4, use_desc=False),
    # Static tile stride (no atomic ticket per tile).
    "m128n128n128k64w8s3-static": MoEKernelConfig(128, 128, 128, 64, 8, 3, ticket=False, use_desc=False),
    # TMA tensor-descriptor loads (use_desc; timed 2026-12-03: moe-tma-h200.md). Shared memory per program
    # (ptxas, sm_90): s3 144 KiB, s4 192 KiB, k128 s2 192 KiB, n64 s4 128 KiB - one program per SM each.
    "m128n128n128k64w8s3-desc": MoEKernelConfig(128, 128, 128, 64, 8, 3, use_desc=True),
    "m128n128n128k64w8s3-desc-static": MoEKernelConfig(128, 128, 128, 64, 8, 3, ticket=False, use_desc=True),
    "m128n128n128k64w8s4-desc": MoEKernelConfig(128, 128, 128, 64, 8, 4, use_desc=True),
    "m128n128n128k64w8s4-desc-static": MoEKernelConfig(128, 128, 128, 64, 8, 4, ticket=False, use_desc=True),
    "m128n128n128k128w8s2-desc": MoEKernelConfig(128, 128, 128, 128, 8, 2, use_desc=True),
    "m128n64n128k64w8s4-desc": MoEKernelConfig(128, 64, 128, 64, 8, 4, use_desc=True),
    # What expert_mlp_combine runs without a config (descriptors where possible; 4 stages with them).
    "default": MoEKernelConfig(),
}


def env_info() -> dict:
    from benchmarks._common import environment

    return environment()


def bench_ms(fn) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median"))


def rank0_layout(shape: dict, world: int, gen: torch.Generator):
    """Rows per local expert of rank 0 and random (dest rank, slot) of each row."""
    E, T = shape["experts"], shape["tokens"]
    El = E // world
    if shape["capacity_factor"] is not None:
        cap = max(1, int(-(-shape["capacity_factor"] * T // E)))
        rows_per_expert = [cap] * El
    else:
        # Top-k with an uneven split (as routing gives): pairs of rank 0's experts out of T * k.
        pairs = T * shape["top_k"]
        share = torch.tensor([1.3, 0.7, 1.1, 0.9] * (E // 4 + 1))[:E]
        per_e = (share / share.sum() * pairs).round().long()
        rows_per_expert = per_e[:El].tolist()
    rows = sum(rows_per_expert)
    dest_rank = torch.randint(0, world, (rows,), generator=gen, dtype=torch.int32)
    dest_row = torch.empty(rows, dtype=torch.int32)
    for r in range(world):
        sel = (dest_rank == r).nonzero().flatten()
        dest_row[sel] = torch.randperm(sel.numel(), generator=gen).to(torch.int32)
    return rows_per_expert, dest_rank, dest_row


class Budget:
    """Wall-clock budget of the whole run: variants past it are recorded as skipped, not silently dropped."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def run_shape(name: str, shape: dict, worlds: list[int], leads: list[int], configs: dict, log, budget: Budget,
              top_configs: int = 2) -> list[dict]:
    H, I, E = shape["hidden"], shape["inter"], shape["experts"]
    results = []
    gen = torch.Generator().manual_seed(0)
    dev = DEVICE
    for world in worlds:
        if E % world:
            continue
        El = E // world
        rows_per_expert, dest_rank, dest_row = rank0_layout(shape, world, gen)
        rows = sum(rows_per_expert)
        offsets = [0] + torch.tensor(rows_per_expert).cumsum(0).tolist()
        flops = 6.0 * rows * H * I
        x = torch.randn(rows, H, device=dev).to(DTYPE)
        gate_up = (torch.randn(El, H, 2 * I, device=dev) * H**-0.5).to(DTYPE)
        down = (torch.randn(El, I, H, device=dev) * I**-0.5).to(DTYPE)
        w = torch.rand(rows, device=dev) + 0.5
        dest_rank, dest_row = dest_rank.to(dev), dest_row.to(dev)
        # All virtual ranks' combine buffers are views of one allocation: the reference scatters once.
        cap = rows
        big = torch.empty(world * cap, H, device=dev, dtype=DTYPE)
        bufs = [big[r * cap : (r + 1) * cap] for r in range(world)]
        table = local_buffer_table(bufs)
        global_row = (dest_rank.long() * cap + dest_row.long()).to(torch.int32)
        zeros_rank = torch.zeros_like(dest_rank)

        def row(variant, ms, **extra):
            r = {"shape": name, "world": world, "variant": variant, "rows": rows, "experts_per_rank": El,
                 "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12 if ms else None, **extra}  # fmt: skip
            results.append(r)
            log(f"{name:10s} P={world} {variant:34s} {ms:8.4f} ms {r['tflops'] or 0:7.1f} TFLOP/s")
            return r

        ref_ms = bench_ms(lambda: expert_mlp_combine_grouped(x, gate_up, down, offsets, w, zeros_rank, global_row, [big]))
        row("reference (grouped_mm+swiglu+scatter)", ref_ms)
        if len(set(rows_per_expert)) == 1:
            xb = x.view(El, rows_per_expert[0], H)
            hb = torch.randn(El, rows_per_expert[0], I, device=dev).to(DTYPE)
            row("bmm L1+L2 only (ceiling)", bench_ms(lambda: (torch.bmm(xb, gate_up), torch.bmm(hb, down))))
        # Correctness of each fused run against the unfused path, on these inputs.
        expert_mlp_combine_grouped(x, gate_up, down, offsets, w, zeros_rank, global_row, [big])
        want = big.clone()
        written = global_row.long()
        if world != worlds[0]:
            # Past the first world size only the fastest configs of the first are timed (device time is short).
            firsts = [r for r in results if r.get("lead") is not None and r["world"] == worlds[0] and "ms" in r]
            ranked = sorted({r["config"]: min(q["ms"] for q in firsts if q["config"] == r["config"]) for r in firsts}.items(),
                            key=lambda kv: kv[1])  # fmt: skip
            keep = [c for c, _ in ranked[:top_configs]] or list(configs)[:top_configs]
            world_configs = {c: configs[c] for c in keep}
        else:
            world_configs = configs
        for cname, cfg in world_configs.items():
            for lead in leads:
                if budget.left() <= 0:
                    results.append({"shape": name, "world": world, "variant": f"fused/{lead}/{cname}",
                                    "error": "skipped: benchmark time budget spent"})  # fmt: skip
                    continue
                try:
                    big.fill_(float("nan"))
                    expert_mlp_combine(x, gate_up, down, offsets, w, dest_rank, dest_row, table, config=cfg, lead=lead)
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    got_rows, want_rows = big[written].float(), want[written].float()
                    err = float((got_rows - want_rows).norm() / want_rows.norm())  # NaN if a row was not written
                    if not err < 2e-2:
                        raise RuntimeError(f"fused output differs from the unfused path: rel err {err}")
                    ms = bench_ms(lambda: expert_mlp_combine(x, gate_up, down, offsets, w, dest_rank, dest_row, table,
                                                             config=cfg, lead=lead))  # fmt: skip
                    row(f"fused/{'wave' if lead == 0 else f'D={lead}'}/{cname}", ms, config=cname, lead=lead,
                        rel_err_vs_reference=err, over_reference=ref_ms / ms)  # fmt: skip
                except Exception as exc:  # noqa: BLE001 - keep measuring the other variants
                    log(f"{name} P={world} {cname} lead={lead}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                    results.append({"shape": name, "world": world, "variant": f"fused/{lead}/{cname}",
                                    "error": f"{type(exc).__name__}: {str(exc)[:300]}"})  # fmt: skip
        del x, gate_up, down, big
        torch.cuda.empty_cache()
    return results


def run_diffusers(log) -> list[dict]:
    """diffusers' own layers at the two shapes (whole layer), if diffusers is importable."""
    out = []
    try:
        from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU
        from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoELayer
    except Exception as exc:  # noqa: BLE001
        log(f"diffusers not importable: {exc}")
        return out
    with torch.no_grad():
        s = SHAPES["nucleusmoe"]
        layer = NucleusMoELayer(s["hidden"], s["inter"], s["experts"], s["capacity_factor"], False, 2.5, True)
        layer = layer.to("cuda", torch.bfloat16).eval()
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
        x = torch.randn(1, s["tokens"], s["hidden"], device="cuda", dtype=torch.bfloat16)
        t = torch.randn(1, s["hidden"], device="cuda", dtype=torch.bfloat16)
        ms = bench_ms(lambda: layer(x, x, t))
        rows = s["tokens"] * s["capacity_factor"]
        flops = 6.0 * rows * s["hidden"] * s["inter"]
        out.append({"shape": "nucleusmoe", "world": 1, "variant": "diffusers NucleusMoELayer (grouped_mm, whole layer)",
                    "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12})  # fmt: skip
        log(f"nucleusmoe diffusers layer {ms:.4f} ms")
        del layer
        s = SHAPES["hidream"]
        hd = MOEFeedForwardSwiGLU(s["hidden"], 4 * s["hidden"], s["experts"], s["top_k"]).to("cuda", torch.bfloat16).eval()
        x = torch.randn(1, s["tokens"], s["hidden"], device="cuda", dtype=torch.bfloat16)
        ms = bench_ms(lambda: hd(x))
        flops = 6.0 * s["tokens"] * s["top_k"] * s["hidden"] * s["inter"]
        out.append({"shape": "hidream", "world": 1, "variant": "diffusers MOEFeedForwardSwiGLU (whole layer)",
                    "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12})  # fmt: skip
        log(f"hidream diffusers layer {ms:.4f} ms")
        del hd
    torch.cuda.empty_cache()
    return out


def summarize(results: list[dict]) -> dict:
    ok = [r for r in results if "ms" in r and r.get("ms")]
    summary: dict = {"interleaved_over_wave": {}, "best_fused": {}}
    for shape in SHAPES:
        for world in sorted({r["world"] for r in ok if r["shape"] == shape}):
            rs = [r for r in ok if r["shape"] == shape and r["world"] == world]
            fused = [r for r in rs if r["variant"].startswith("fused/")]
            ref = [r for r in rs if r["variant"].startswith("reference")]
            if not fused or not ref:
                continue
            best = min(fused, key=lambda r: r["ms"])
            waves = [r for r in fused if r["lead"] == 0 and r["config"] == best["config"]]
            inter = [r for r in fused if r["lead"] > 0 and r["config"] == best["config"]]
            key = f"{shape}/P={world}"
            summary["best_fused"][key] = {"variant": best["variant"], "ms": best["ms"], "tflops": best["tflops"],
                                          "over_reference": ref[0]["ms"] / best["ms"]}  # fmt: skip
            if waves and inter:
                bi = min(inter, key=lambda r: r["ms"])
                summary["interleaved_over_wave"][key] = {"best_lead": bi["lead"], "ratio": waves[0]["ms"] / bi["ms"],
                                                         "config": best["config"]}  # fmt: skip
            if shape == "nucleusmoe" and world == 1:
                summary["fused_over_reference"] = ref[0]["ms"] / best["ms"]
    summary["speedup_over_serial"] = None
    summary["speedup_over_serial_note"] = "not measured: multi-GPU machines were withheld in this session"
    return summary


def write_markdown(path: Path, info: dict, results: list[dict], summary: dict) -> None:
    lines = [f"# MoE expert MLP + combine on {info['gpu']}", "",
             f"torch {info['torch']}, triton {info['triton']}, CUDA {info['cuda']}, driver {info['driver']}, "
             f"commit {info['git_commit']}, {info['time_utc']}.", "",
             "One GPU; P virtual ranks: rank 0 holds E/P experts and all their rows, combine rows go to P buffers "
             "through a pointer table. Baseline column: our unfused reference (grouped_mm + SwiGLU + weighting + "
             "scatter) in the same run. TFLOP/s count the expert MLP only (6*rows*hidden*inter).", "",
             "| shape | P | variant | ms | TFLOP/s | vs reference |", "|---|---|---|---|---|---|"]  # fmt: skip
    refs = {(r["shape"], r["world"]): r["ms"] for r in results if r.get("variant", "").startswith("reference") and "ms" in r}
    for r in results:
        if "ms" not in r:
            lines.append(f"| {r['shape']} | {r['world']} | {r['variant']} | FAILED: {r.get('error', '')[:80]} | | |")
            continue
        base = refs.get((r["shape"], r["world"]))
        vs = f"{base / r['ms']:.2f}x" if base and not r["variant"].startswith("diffusers") else ""
        lines.append(f"| {r['shape']} | {r['world']} | {r['variant']} | {r['ms']:.4f} | {r['tflops'] or 0:.0f} | {vs} |")
    lines += ["", "## Summary", "", "```json", json.dumps(summary, indent=2), "```", ""]
    path.write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/moe-combine-h200", help="output path without extension")
    ap.add_argument("--worlds", default="1,2,4,8")
    ap.add_argument("--leads", default="0,1,2,3,4")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {list(CONFIGS)}")
    ap.add_argument("--shapes", default="nucleusmoe,hidream")
    ap.add_argument("--budget-s", type=float, default=600.0, help="wall-clock budget; later variants are skipped")
    ap.add_argument("--top-configs", type=int, default=2, help="configs kept past the first world size")
    args = ap.parse_args(argv)
    unknown = [k for k in args.configs.split(",") if k not in CONFIGS]
    if unknown:
        print(f"bench_moe_combine: expected configs from {list(CONFIGS)}, got unknown {unknown}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_moe_combine: needs a CUDA GPU, found none", file=sys.stderr)
        return 2
    worlds = [int(v) for v in args.worlds.split(",")]
    leads = [int(v) for v in args.leads.split(",")]
    configs = {k: CONFIGS[k] for k in args.configs.split(",")}
    info = env_info()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    budget = Budget(args.budget_s)

    def log(msg):
        print(msg, flush=True)

    def flush():
        summary = summarize(results)
        out.with_suffix(".json").write_text(json.dumps({"env": info, "summary": summary, "results": results}, indent=1))
        write_markdown(out.with_suffix(".md"), info, results, summary)
        return summary

    results += run_diffusers(log)
    for name in args.shapes.split(","):
        results += run_shape(name, SHAPES[name], worlds, leads, configs, log, budget, args.top_configs)
        flush()
    summary = flush()
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
