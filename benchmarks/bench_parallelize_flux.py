"""`parallelize` on the full-size FLUX.1 transformer, one denoising step at 1024x1024 (4096 image + 512 text
tokens, 24 heads x 128, bf16, random weights): world 1 against plain diffusers, and 2 ranks sharing one GPU
against world 1.

Rows (CUDA-event medians after warm-up, all measured in this run, same inputs):

- ``diffusers-native``: plain diffusers, default attention backend (torch SDPA, which picks its kernel);
- ``diffusers-cudnn``: plain diffusers with ``set_attention_backend("_native_cudnn")``;
- ``xstage-w1-serial``: ``parallelize`` at world 1, schedule "serial" (the op's cuDNN SDPA path): same
  attention kernel family as ``diffusers-cudnn``;
- ``xstage-w1-fused``: ``parallelize`` at world 1, schedule "fused" (the op's Triton kernel);
- ``xstage-w2-shared``: ``parallelize(sp=2)`` as two processes sharing the GPU (gloo control, symmetric
  memory data); both ranks run at once on one GPU, so its time is a correctness run, not a speedup.

Writes ``parallelize-flux-<gpu>.json`` / ``.md`` with a top-level ``summary``: ``w1_fused_over_native`` and
``w1_serial_over_cudnn`` (plain time / xstage time: >= 1 means parallelize is not slower), and
``w2_vs_w1_max_abs`` / ``w2_vs_w1_rel_l2`` (output of 2 ranks vs world 1).

    python benchmarks/bench_parallelize_flux.py --out benchmarks/results [--commit SHA]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from xstage_dit.jsonable import to_jsonable  # noqa: E402

SIZE = dict(image_tokens=4096, text_tokens=512, channels=64, text_dim=4096, pooled_dim=768)
# --smoke: the same script on the CPU with the tiny FLUX (checks the plumbing before spending GPU time)
SMOKE = os.environ.get("XSTAGE_BENCH_SMOKE") == "1"
if SMOKE:
    SIZE = dict(image_tokens=64, text_tokens=16, channels=16, text_dim=32, pooled_dim=32)


def _inputs(device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = SIZE
    x = dict(
        hidden_states=torch.randn(1, s["image_tokens"], s["channels"], generator=g),
        encoder_hidden_states=torch.randn(1, s["text_tokens"], s["text_dim"], generator=g),
        pooled_projections=torch.randn(1, s["pooled_dim"], generator=g),
        timestep=torch.tensor([0.5]),
        guidance=torch.tensor([3.5]),
    )
    x = {k: v.to(device=device, dtype=dtype) for k, v in x.items()}
    side = int(s["image_tokens"] ** 0.5)
    img_ids = torch.zeros(side, side, 3)
    img_ids[..., 1] += torch.arange(side)[:, None]
    img_ids[..., 2] += torch.arange(side)[None, :]
    x["img_ids"] = img_ids.reshape(-1, 3).to(device)
    x["txt_ids"] = torch.zeros(s["text_tokens"], 3, device=device)
    x["return_dict"] = False
    return x


def _build(device, dtype):
    from xstage_dit.families.flux import build_transformer

    return build_transformer("tiny" if SMOKE else "full", dtype=dtype, device=device, seed=0)


def _time_ms(fn, warmup: int, reps: int) -> tuple[float, list[float]]:
    for _ in range(warmup):
        fn()
    if SMOKE:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), times
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), times


def single(args) -> dict:
    """World-1 rows; saves the world-1 outputs for the 2-rank comparison."""
    from xstage_dit.features import ParallelConfig, parallelize

    device, dtype = (torch.device("cpu"), torch.float32) if SMOKE else (torch.device("cuda"), torch.bfloat16)
    t0 = time.perf_counter()
    model = _build(device, dtype)
    print(f"built full FLUX transformer in {time.perf_counter() - t0:.1f} s", flush=True)
    x = _inputs(device, dtype)
    rows, outs = [], {}

    def run():
        return model(**x)[0]

    with torch.no_grad():
        for name, setup in (
            ("diffusers-native", None),
            ("diffusers-cudnn", "cudnn"),
            ("xstage-w1-serial", "serial"),
            ("xstage-w1-fused", "fused"),
        ):
            handle = None
            if setup == "cudnn" and not SMOKE:
                model.set_attention_backend("_native_cudnn")
            elif setup in ("serial", "fused"):
                handle = parallelize(model, ParallelConfig(schedule=setup, calibrate=False))
            try:
                outs[name] = run().float().cpu()
                ms, times = _time_ms(run, args.warmup, args.reps)
            except Exception as exc:  # report the row as failed, keep measuring the others
                print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
                rows.append({"name": name, "error": f"{type(exc).__name__}: {exc}"})
                continue
            finally:
                if handle is not None:
                    handle.restore()
                if setup == "cudnn" and not SMOKE:
                    model.reset_attention_backend()
            rows.append({"name": name, "ms": ms, "times_ms": times})
            print(f"{name}: {ms:.2f} ms (median of {args.reps})", flush=True)
    for name, out in outs.items():
        torch.save(out, Path(args.out) / f"flux-w1-{name}.pt")
    ref = outs.get("diffusers-native")
    for row in rows:
        if ref is not None and row["name"] in outs:
            d = outs[row["name"]] - ref
            row["max_abs_vs_native"] = float(d.abs().max())
            row["rel_l2_vs_native"] = float(d.norm() / ref.norm())
    del model
    torch.cuda.empty_cache()
    return {"rows": rows}


def rank_main(args) -> int:
    """One of the 2 ranks sharing the GPU: parallelize(sp=2), check, time; rank 0 saves its output."""
    from xstage_dit.comm.distributed import init_distributed
    from xstage_dit.features import ParallelConfig, parallelize

    info = init_distributed(timeout_s=300)
    dtype = torch.float32 if SMOKE else torch.bfloat16
    model = _build(info.device, dtype)
    x = _inputs(info.device, dtype)
    handle = parallelize(model, ParallelConfig(sp=info.world_size, schedule=args.w2_schedule, calibrate=False))
    with torch.no_grad():
        out = model(**x)[0]
        ms, times = _time_ms(lambda: model(**x)[0], 1, max(2, args.reps // 2))
    if info.rank == 0:
        torch.save(out.float().cpu(), Path(args.out) / "flux-w2.pt")
        (Path(args.out) / "flux-w2.json").write_text(json.dumps(
            {"ms": ms, "times_ms": times, "schedule": args.w2_schedule, "choices": to_jsonable(handle.schedule_choices)}))
    handle.restore()
    return 0


def _env_info(commit: str | None) -> dict:
    from benchmarks._common import environment

    return environment(commit)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--commit", default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--w2-schedule", default="fused", choices=("fused", "serial", "auto"))
    p.add_argument("--w2-timeout", type=float, default=90.0, help="seconds for the 2-rank run")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.rank:
        return rank_main(args)

    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    result = {"benchmark": "parallelize-flux", "shape": dict(SIZE, heads=24, head_dim=128, dtype="bfloat16",
              source="FLUX.1-dev transformer at 1024x1024, one step"), **_env_info(args.commit)}
    result.update(single(args))
    gpu = result["gpu"].split()[-1].lower() if result.get("gpu") else "gpu"
    stem = Path(args.out) / f"parallelize-flux-{gpu}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))  # kept if the 2-rank run is cut short

    from xstage_dit.comm.launcher import launch

    t0 = time.perf_counter()
    code = launch(2, [sys.executable, __file__, "--rank", "--out", args.out, "--reps", str(args.reps),
                      "--w2-schedule", args.w2_schedule], timeout_s=args.w2_timeout)
    w2 = {"exit_code": code, "wall_s": time.perf_counter() - t0}
    if code != 0 and args.w2_schedule != "serial":
        # the fused schedule failed across processes: the serial one still checks the sharding
        print(f"2 ranks with schedule {args.w2_schedule} exited with {code}: trying serial", flush=True)
        w2["failed_schedule"] = args.w2_schedule
        args.w2_schedule = "serial"
        t0 = time.perf_counter()
        code = launch(2, [sys.executable, __file__, "--rank", "--out", args.out, "--reps", "2",
                          "--w2-schedule", "serial"], timeout_s=args.w2_timeout)
        w2.update(exit_code=code, wall_s=time.perf_counter() - t0)
    w2_path, w2_json = Path(args.out) / "flux-w2.pt", Path(args.out) / "flux-w2.json"
    if code == 0 and w2_path.exists():
        w2.update(json.loads(w2_json.read_text()))
        out2 = torch.load(w2_path)
        ref_name = "xstage-w1-fused" if args.w2_schedule == "fused" else "xstage-w1-serial"
        ref_path = Path(args.out) / f"flux-w1-{ref_name}.pt"
        if not ref_path.exists():
            ref_path = Path(args.out) / "flux-w1-diffusers-native.pt"
        ref = torch.load(ref_path)
        d = out2 - ref
        w2.update(compared_to=ref_path.stem, max_abs=float(d.abs().max()), rel_l2=float(d.norm() / ref.norm()),
                  ref_abs_max=float(ref.abs().max()))
    result["w2_shared_gpu"] = w2

    ms = {r["name"]: r.get("ms") for r in result["rows"]}
    def ratio(a, b):
        return None if not ms.get(a) or not ms.get(b) else ms[a] / ms[b]
    result["summary"] = {
        "w1_fused_over_native": ratio("diffusers-native", "xstage-w1-fused"),
        "w1_serial_over_cudnn": ratio("diffusers-cudnn", "xstage-w1-serial"),
        "w1_fused_over_cudnn": ratio("diffusers-cudnn", "xstage-w1-fused"),
        "w2_vs_w1_max_abs": w2.get("max_abs"),
        "w2_vs_w1_rel_l2": w2.get("rel_l2"),
        "note": "ratios are plain-diffusers time / xstage time (>= 1: parallelize not slower); w2 = 2 ranks sharing one GPU",
    }
    for f in Path(args.out).glob("flux-w*.pt"):
        f.unlink()
    (Path(args.out) / "flux-w2.json").unlink(missing_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [f"# parallelize: full FLUX.1 transformer, one step at 1024x1024 (bf16) on {result['gpu']}", "",
             f"torch {result['torch']}, triton {result['triton']}, driver {result['driver']}, commit {result['git_commit']}", "",
             "| variant | median ms | plain diffusers (native) / variant | max abs vs native | rel L2 vs native |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        if "ms" not in r:
            lines.append(f"| {r['name']} | failed: {r['error'][:80]} | | | |")
            continue
        lines.append(f"| {r['name']} | {r['ms']:.2f} | {ms['diffusers-native'] / r['ms']:.3f} | "
                     f"{r.get('max_abs_vs_native', float('nan')):.3g} | {r.get('rel_l2_vs_native', float('nan')):.3g} |")
    lines += ["", f"2 ranks sharing the GPU (sp=2, schedule {args.w2_schedule}): exit {w2['exit_code']}, "
              + (f"{w2['ms']:.2f} ms per step (both ranks on one GPU), vs {w2.get('compared_to')}: max abs "
                 f"{w2['max_abs']:.3g}, rel L2 {w2['rel_l2']:.3g}" if "ms" in w2 else "no result"), "",
              "summary: " + json.dumps(result["summary"])]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
