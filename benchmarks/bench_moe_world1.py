"""Benchmark: NucleusMoE's MoE layer at world 1, diffusers' ``NucleusMoELayer`` vs the EP layer's world-1
expert-choice path (``ops.moe.expert_choice``: static offsets, fused kernel, no host sync), eager and
compiled, on one GPU.

Shape (``xstage_dit/families/nucleusmoe.py`` "full"): hidden 2048, 64 experts x 1344, the two capacity factors
of its MoE blocks (4.0 in two blocks, 2.0 in 27); 1024^2 -> 4096 image tokens, batch 2 (CFG). Random
weights (timing does not depend on their values), bf16. Rows, per capacity factor: ``diffusers`` (eager,
the baseline column), ``ep-world1/fused`` (eager), and both under ``torch.compile`` (Inductor,
``dynamic=False``, as the server's regional compile of a block), diffusers' layer compiled twice: stock (fails
with torch 2.11: int64 grouped-matmul offsets) and with ``patches.compile_fixes`` (what parallelize gives a
layer it keeps). Each time is the median over interleaved
rounds of medians of CUDA-event timings after warm-up (``_common.time_ms``, ``_common.interleaved_times``).
Also recorded: the relative error of the EP output against diffusers' layer, the schedule's reason, and whether
each variant repeats bit for bit (``repeats``: five more calls against the first; ``repeat_max_abs``: their
largest difference). Diffusers' layer sums each token's gates and its experts' outputs with ``scatter_add``,
atomic on CUDA; the EP path sums in a fixed order: this column is what serving a seeded image twice depends on.
The ``(deterministic)`` rows run diffusers' layer under ``torch.use_deterministic_algorithms(True)``, where torch
routes ``scatter_add`` through its sorted ``index_put_`` accumulation: what repeatability would cost it.

Usage: ``python benchmarks/bench_moe_world1.py --out-dir benchmarks/results/moe``
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import environment, interleaved_times, time_ms, write_results  # noqa: E402
from xstage_dit.bench.session import gpu_label  # noqa: E402
from xstage_dit.families.nucleusmoe import TRANSFORMER  # noqa: E402
from xstage_dit.features.compile_fixes import fix_grouped_mm_offsets  # noqa: E402
from xstage_dit.features.ep_layers import NucleusMoEEPLayer  # noqa: E402

BATCH = 2  # classifier-free guidance: the conditional and unconditional rows in one call
TOKENS = 4096  # 1024^2 image: (1024 / 8 / 2)^2 patches


def build(capacity_factor: float, dtype=torch.bfloat16):
    from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoELayer

    full = TRANSFORMER["full"]
    hidden = full["num_attention_heads"] * full["attention_head_dim"]
    torch.manual_seed(0)
    layer = NucleusMoELayer(hidden, full["moe_intermediate_dim"], full["num_experts"], capacity_factor,
                            full["use_sigmoid"], full["route_scale"], full["use_grouped_mm"])
    layer = layer.to("cuda", dtype).eval()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x, u = (torch.randn(BATCH, TOKENS, hidden, device="cuda", dtype=dtype) for _ in range(2))
    t = torch.randn(BATCH, hidden, device="cuda", dtype=dtype)
    return layer, NucleusMoEEPLayer.from_layer(layer, None, path="fused"), (x, u, t)


def deterministic(fn):
    """`fn` called under torch's deterministic algorithms (warn, not fail, where an op has none), the mode put back
    after each call."""

    def call():
        enabled, warn_only = torch.are_deterministic_algorithms_enabled(), \
            torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            return fn()
        finally:
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)

    return call


def run_factor(cf: float, *, rounds: int, reps: int, compile_: bool, log) -> list[dict]:
    layer, ep, args = build(cf)
    fns = {"diffusers": lambda: layer(*args), "ep-world1/fused": lambda: ep(*args),
           "diffusers (deterministic)": deterministic(lambda: layer(*args))}
    failed: dict[str, str] = {}  # variant -> why it could not run (recorded as a row, never dropped)
    with torch.no_grad():
        ref, out = layer(*args), ep(*args)
        rel = float((out.float() - ref.float()).norm() / ref.float().norm())
        if compile_:
            torch._dynamo.reset()
            # What parallelize gives a layer it keeps (patches.compile_fixes), on a copy so that the eager
            # baseline stays stock diffusers (stock diffusers fails to compile here).
            fixed = copy.deepcopy(layer)
            fix_grouped_mm_offsets(fixed)
            for name, module in (("diffusers compiled", layer), ("diffusers compiled (int32 offsets)", fixed),
                                 ("ep-world1/fused compiled", ep)):
                compiled = torch.compile(module, dynamic=False)
                try:
                    compiled(*args)  # compile outside the timed rounds
                except Exception as e:  # noqa: BLE001 - e.g. diffusers' grouped_mm with int64 offsets under Inductor
                    failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                    log(f"cf {cf}: {name} failed: {failed[name]}")
                    continue
                fns[name] = lambda c=compiled: c(*args)
            # the int32-offsets layer again, compiled and called under deterministic algorithms (its own copy: a
            # graph compiled in that mode is another graph)
            fixed_det = copy.deepcopy(fixed)
            compiled_det = deterministic(lambda c=torch.compile(fixed_det, dynamic=False): c(*args))
            name = "diffusers compiled (int32 offsets, deterministic)"
            try:
                compiled_det()
                fns[name] = compiled_det
            except Exception as e:  # noqa: BLE001 - recorded as a row, as above
                failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                log(f"cf {cf}: {name} failed: {failed[name]}")
        rounds_ms = interleaved_times(fns, lambda fn: time_ms(fn, warmup=3, reps=reps)["median_ms"], rounds=rounds)
        repeats = {name: repeat_check(fn) for name, fn in fns.items()}
    base = statistics.median(rounds_ms["diffusers"])
    rows = [{"capacity_factor": cf, "variant": name, "ms": None, "min_round_ms": None, "max_round_ms": None,
             "vs_diffusers_eager": None, "rel_err_vs_diffusers": None, "repeats": None, "repeat_max_abs": None,
             "failed": why} for name, why in failed.items()]
    for name, ms in rounds_ms.items():
        med = statistics.median(ms)
        rows.append({"capacity_factor": cf, "variant": name, "ms": med, "min_round_ms": min(ms), "max_round_ms": max(ms),
                     "vs_diffusers_eager": base / med, "rel_err_vs_diffusers": rel if name.startswith("ep") else None,
                     **repeats[name]})
        log(f"cf {cf}: {name} {med:.3f} ms ({base / med:.2f}x diffusers eager), repeats bit for bit: "
            f"{repeats[name]['repeats']} (max abs {repeats[name]['repeat_max_abs']:.3g})")
    next(r for r in rows if r["variant"] == "ep-world1/fused")["reason"] = ep.schedule_choice.reason
    del layer, ep
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return rows


def repeat_check(fn, calls: int = 5) -> dict:
    """{"repeats": whether `calls` more calls of `fn` equal its first output bit for bit, "repeat_max_abs": the
    largest absolute difference among them}."""
    first = fn().float()
    worst = max(float((fn().float() - first).abs().max()) for _ in range(calls))
    return {"repeats": worst == 0.0, "repeat_max_abs": worst}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="benchmarks/results/moe")
    ap.add_argument("--capacity-factors", default="2.0,4.0", help="the full model's: 2.0 (27 blocks), 4.0 (2)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true", help="eager rows only")
    ap.add_argument("--commit", default=None, help="the commit to record (a tree without .git)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe_world1: needs a CUDA GPU, found none", file=sys.stderr)
        return 2
    env = environment(args.commit)
    rows = []
    for cf in (float(v) for v in args.capacity_factors.split(",")):
        rows += run_factor(cf, rounds=args.rounds, reps=args.reps, compile_=not args.no_compile,
                           log=lambda m: print(m, flush=True))
    summary = {f"cf{r['capacity_factor']}/{r['variant']}": (round(r["vs_diffusers_eager"], 3) if r["ms"] else "failed")
               for r in rows}
    tag = (env.get("git_commit") or "unknown")[:7]
    stem = Path(args.out_dir) / f"world1-nucleusmoe-{gpu_label(torch.device('cuda'))}-{tag}"
    notes = ("Per-layer time, NucleusMoE full-size MoE layer at world 1 (hidden 2048, 64 experts x 1344, 2 x 4096 "
             "tokens, bf16). Baseline column: diffusers' NucleusMoELayer eager, same run, interleaved rounds.")
    write_results(stem, "moe-world1", rows, summary,
                  ["capacity_factor", "variant", "ms", "min_round_ms", "max_round_ms", "vs_diffusers_eager",
                   "rel_err_vs_diffusers", "repeats", "repeat_max_abs", "failed"], notes=notes, env=env)  # fmt: skip
    print(f"wrote {stem}.json / .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
