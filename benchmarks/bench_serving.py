"""Load test of the server on one GPU: c concurrent image requests per size, first come first served
("never") against batched ("always"), and what the batcher ("auto") picks from its warm-up measurement.

One pipeline is built, parallelized at world 1 and compiled (--compile) once; a first server with
batching "auto" warms up every size (compiling batch 1 and batch --max-batch-size shapes) and records its
decision per size; then one server per policy (no warm-up needed any more) answers --concurrency
requests at each size, all sent at once. Per (size, concurrency, policy): mean and p95 latency, images
per second. The better policy is the one with the lower mean latency (what the average user waits);
``auto_agrees`` says whether the batcher picked it. Results are written after every measurement (JSON +
Markdown under --out), so a run stopped by its time limit keeps what it measured.

Example::

    python benchmarks/bench_serving.py --model full-flux --sizes 1024x1024,512x512 --concurrency 4,16 \\
        --steps 10 --time-budget-s 240 --out .gpu_out/serving

The load test is the default (``load`` may also be named); the other parts of a served request are measured by
subcommands, each with its own ``--help`` and module beside this script:

    python benchmarks/bench_serving.py served-path ...       # bare call vs the server's runner / worker / HTTP
    python benchmarks/bench_serving.py transport ...         # keep-alive HTTP round trips by answer size
    python benchmarks/bench_serving.py png ...               # the server's PNG encode on its own thread
    python benchmarks/bench_serving.py batch-invariance ...  # is a batched bf16 GEMM the one-sample GEMM (GPU)
    python benchmarks/bench_serving.py lora ...              # per-request LoRA: adapter, switch, recompiles (GPU)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, when run as a script

from benchmarks._common import environment, write_results  # noqa: E402
from xstage_dit.features.compile import COMPILE_MODES  # noqa: E402

# subcommand -> its module in benchmarks/ (each has main(argv) -> exit status)
SUBCOMMANDS = {
    "served-path": "_serving_served_path",
    "transport": "_serving_transport",
    "png": "_serving_png",
    "batch-invariance": "_serving_batch_invariance",
    "lora": "_serving_lora",
}
COLUMNS = ["size", "concurrency", "policy", "status", "mean_s", "p95_s", "images_per_s", "max_batch", "reason"]


def _sizes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        w, _, h = part.strip().partition("x")
        out.append((int(w), int(h)))
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def _burst(url: str, bodies: list[dict]) -> tuple[list[float], list[int], float]:
    import httpx

    async def one(client, body):
        t0 = time.perf_counter()
        r = await client.post("/v1/images/generations", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"expected 200, got {r.status_code}: {r.text[:200]}")
        return time.perf_counter() - t0, r.json()["batch_size"]

    limits = httpx.Limits(max_connections=len(bodies) + 2)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(client, b) for b in bodies))
        wall = time.perf_counter() - t0
    return [r[0] for r in results], [r[1] for r in results], wall


def main(argv: list[str] | None = None) -> int:
    """The load test, or the subcommand named first (`SUBCOMMANDS`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        return importlib.import_module(f"benchmarks.{SUBCOMMANDS[argv[0]]}").main(argv[1:])
    if argv and argv[0] == "load":
        argv = argv[1:]
    return load_test(argv)


def load_test(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=f"subcommands (each with --help): load (this, the default), "
                                       f"{', '.join(SUBCOMMANDS)}")
    p.add_argument("--model", default="tiny-flux")
    p.add_argument("--sizes", default="1024x1024,512x512", help="WxH[,WxH...]")
    p.add_argument("--concurrency", default="4,16", help="requests sent at once, comma-separated")
    p.add_argument("--steps", type=int, default=None, help="denoising steps per request (default: the model's)")
    p.add_argument("--policies", default="never,always", help="batching policies measured (auto decides too)")
    p.add_argument("--max-batch-size", type=int, default=4)
    p.add_argument("--batch-margin", type=float, default=0.10)
    p.add_argument("--compile", default=None, choices=COMPILE_MODES,
                   help="default: regional on a GPU, off on a CPU")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--time-budget-s", type=float, default=0.0, help="0 = unlimited")
    p.add_argument("--out", default="benchmarks/results/serving")
    args = p.parse_args(argv)
    t_start = time.perf_counter()

    import torch

    from xstage_dit.families import load_pipeline, model_spec
    from xstage_dit.features import ParallelConfig, parallelize
    from xstage_dit.features.compile import apply_compile, default_compile_mode
    from xstage_dit.server.inprocess import serve_pipeline

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    spec = model_spec(args.model)
    sizes, counts = _sizes(args.sizes), [int(c) for c in args.concurrency.split(",")]
    for w, h in sizes:
        spec.check_size(h, w, spec.frames)
    steps = args.steps or spec.steps
    mode = args.compile or default_compile_mode(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gpu = torch.cuda.get_device_name(device).replace(" ", "-") if device.type == "cuda" else "cpu"
    stem = Path(args.out) / f"serving-{args.model}-1x{gpu}"
    rows: list[dict] = []
    summary: dict = {"model": args.model, "steps": steps, "compile": mode, "max_batch_size": args.max_batch_size,
                     "batch_margin": args.batch_margin, "sizes": [f"{w}x{h}" for w, h in sizes],
                     "concurrency": counts, "policies": args.policies.split(",")}
    env = environment()

    def save() -> None:
        summary["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        summary["verdicts"] = verdicts(rows, summary.get("auto"))
        table = [{k: r.get(k) for k in COLUMNS} for r in rows] or [{"status": "no measurement yet"}]
        write_results(stem, "serving", rows, summary, COLUMNS, env=env, notes=_notes(summary), table_rows=table)

    def left() -> float:
        return args.time_budget_s - (time.perf_counter() - t_start) if args.time_budget_s else float("inf")

    server_kw = dict(max_batch_size=args.max_batch_size, batch_margin=args.batch_margin, batch_wait_s=0.05,
                     max_queue=max(counts) + 4, max_steps=max(100, steps), max_n=1, request_timeout_s=3600.0,
                     max_size=max(2048, *[max(s) for s in sizes]),
                     max_pixels=max(2048 * 2048, *[w * h for w, h in sizes]))
    t0 = time.perf_counter()
    pipe = load_pipeline(args.model, dtype=dtype, device=device, seed=0)
    # World 1: the serial attention schedule needs no calibration (its minutes go to requests instead).
    parallelize(pipe, ParallelConfig(schedule="serial", calibrate=False))
    compiled = apply_compile(pipe, mode)
    summary["build_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    try:
        with serve_pipeline(pipe, args.model, spec, batching="auto", warmup_sizes=tuple(sizes),
                            **server_kw) as (_, w):
            summary["auto"] = w.batcher.report()
    except Exception as exc:  # noqa: BLE001 - recorded; the measured policies still run
        summary["auto"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)[-2000:]}
    summary["warmup_s"] = round(time.perf_counter() - t0, 1)
    summary["compile_how"] = compiled.describe()
    save()
    single_s: dict = {}
    for policy in args.policies.split(","):
        try:
            with serve_pipeline(pipe, args.model, spec, batching=policy, warmup=False, **server_kw) as (url, _):
                for w, h in sizes:
                    for c in counts:
                        row = {"size": f"{w}x{h}", "concurrency": c, "policy": policy}
                        estimate = single_s.get((w, h), 0.0) * c
                        if estimate > left():
                            row.update(status="skipped",
                                       reason=f"time budget: ~{estimate:.0f} s needed, {left():.0f} s left")
                            rows.append(row)
                            save()
                            continue
                        bodies = [{"prompt": f"a photo of object {i}", "seed": i, "size": f"{w}x{h}",
                                   "num_inference_steps": steps} for i in range(c)]
                        try:
                            latencies, batches, wall = asyncio.run(_burst(url, bodies))
                            row.update(status="ok", mean_s=statistics.mean(latencies), p95_s=percentile(latencies, 95),
                                       images_per_s=c / wall, wall_s=wall, max_batch=max(batches),
                                       latencies_s=latencies)
                            single_s[(w, h)] = max(single_s.get((w, h), 0.0), wall / c)
                        except Exception as exc:  # noqa: BLE001
                            row.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
                        rows.append(row)
                        print(f"[serving] {row}", flush=True)
                        save()
        except Exception as exc:  # noqa: BLE001 - a policy's server failed: recorded, the next one runs
            rows.append({"policy": policy, "status": "failed", "reason": f"{type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc(limit=6)[-2000:]})
            save()
    save()
    print(f"[serving] wrote {stem}.json and {stem}.md", flush=True)
    return 0


def verdicts(rows: list[dict], auto: dict | None) -> list[dict]:
    """Per (size, concurrency): FIFO vs batched, the better (lower mean latency), and whether auto picked it."""
    out = []
    ok = [r for r in rows if r.get("status") == "ok"]
    for key in sorted({(r["size"], r["concurrency"]) for r in ok}):
        by = {r["policy"]: r for r in ok if (r["size"], r["concurrency"]) == key}
        if "never" not in by or "always" not in by:
            continue
        better = "always" if by["always"]["mean_s"] < by["never"]["mean_s"] else "never"
        decided = ((auto or {}).get("sizes") or {}).get(key[0])
        picked = None if decided is None else ("always" if decided["batch"] else "never")
        out.append({"size": key[0], "concurrency": key[1], "better": better,
                    "fifo_mean_s": by["never"]["mean_s"], "batched_mean_s": by["always"]["mean_s"],
                    "fifo_images_per_s": by["never"]["images_per_s"],
                    "batched_images_per_s": by["always"]["images_per_s"],
                    "auto_picked": picked, "auto_agrees": None if picked is None else picked == better,
                    "auto_reason": None if decided is None else decided["reason"]})
    return out


def _notes(summary: dict) -> str:
    lines = [f"Batcher decisions at warm-up (auto, margin {summary['batch_margin']:.0%}): "
             f"{(summary.get('auto') or {}).get('sizes', summary.get('auto'))}", ""]
    for v in summary.get("verdicts", []):
        lines.append(f"- {v['size']} x{v['concurrency']}: FIFO mean {v['fifo_mean_s']:.2f} s "
                     f"({v['fifo_images_per_s']:.2f} img/s) vs batched {v['batched_mean_s']:.2f} s "
                     f"({v['batched_images_per_s']:.2f} img/s): better {v['better']}, auto picked {v['auto_picked']}"
                     f" ({'agrees' if v['auto_agrees'] else 'disagrees' if v['auto_agrees'] is False else 'n/a'}: "
                     f"{v['auto_reason']})")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
