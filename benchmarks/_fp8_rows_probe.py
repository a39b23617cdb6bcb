"""Which linear shapes torch's row-wise FP8 GEMM takes, by row count (issue 41).

NucleusMoE's FP8 rows failed on the H100 with CUBLAS_STATUS_NOT_SUPPORTED in its timestep embedder's second layer
(one row, 8192 -> 2048), for the peers' torchao recipe and ours alike. This runs every distinct linear shape of the
full-size transformers of `--models` (built on the meta device for their shapes) through torchao's row-wise
float8 linear (the recipe both use) at each of `--rows`, on fresh random bf16 data, and records which raise: the
evidence behind the family records' ``fp8_row_refused``, and a check that each named layer still needs it. For a
shape that fails at some row count it also finds the least row count that runs (bisecting between a failing and a
running count: a layer that sees fewer rows in some request would fail there), and whether the same shape without
its bias runs at the failing count (the 76e676a run: every failing shape had a bias and K >= 8192, and no
bias-free shape failed, up to 10240 -> 3840).

    python benchmarks/bench_fp8_error.py probe-rows --out-dir benchmarks/results/fp8 --tag 1xh100-<commit>
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks._common import write_results
from xstage_dit.families import load_transformer
from xstage_dit.features.fp8 import ACTIVATION_AMAX_FLOOR, row_refused_layers


def shapes(model: str) -> tuple[dict[tuple[int, int, bool], list[str]], dict[str, str]]:
    """((in, out, bias) -> the module paths of `model`'s transformer with that linear shape, the paths its family
    record's ``fp8_row_refused`` names -> the pattern: `features.fp8.row_refused_layers`)."""
    transformer = load_transformer(model, dtype=torch.bfloat16, device="meta")
    out: dict[tuple[int, int, bool], list[str]] = {}
    for path, m in transformer.named_modules():
        if isinstance(m, torch.nn.Linear):
            out.setdefault((m.in_features, m.out_features, m.bias is not None), []).append(path)
    return out, row_refused_layers(transformer)


def run_shape(k: int, n: int, bias: bool, rows: int) -> str | None:
    """None where torchao's row-wise FP8 linear (k -> n) runs on `rows` rows, else the error's first line."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    layer = torch.nn.Linear(k, n, bias=bias, device="cuda", dtype=torch.bfloat16)
    quantize_(layer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(),
                                                               activation_value_lb=ACTIVATION_AMAX_FLOOR))
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    try:
        with torch.inference_mode():
            y = layer(x)
        torch.cuda.synchronize()
        return None if bool(torch.isfinite(y).all()) else "non-finite output"
    except RuntimeError as exc:
        return str(exc).splitlines()[0][:200]


def least_running_rows(k: int, n: int, bias: bool, failing: int, running: int) -> int:
    """The least row count in (failing, running] at which the k -> n row-wise FP8 linear runs, by bisection
    (assumes one threshold between the two, which the bisection's own points check only where it lands)."""
    while running - failing > 1:
        mid = (failing + running) // 2
        if run_shape(k, n, bias, mid) is None:
            running = mid
        else:
            failing = mid
    return running


def failure_facts(k: int, n: int, bias: bool, errors: dict[int, str | None]) -> dict:
    """For a shape that failed at some of its row counts: the least row count that runs (None when none did) and
    the bias-free shape's result at the largest failing count (None = ran; only for shapes with a bias)."""
    failing = max(r for r, e in errors.items() if e)
    running = [r for r, e in errors.items() if e is None and r > failing]
    facts = {"runs_from_rows": least_running_rows(k, n, bias, failing, min(running)) if running else None}
    if bias:
        facts[f"without_bias_at_{failing}_rows"] = run_shape(k, n, False, failing)
    return facts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_fp8_error.py probe-rows", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="full-nucleusmoe,full-flux,full-wan")
    p.add_argument("--rows", default="1,2,16,4096", help="row counts (M) to try each shape at")
    p.add_argument("--out-dir", default=".")
    p.add_argument("--tag", default="gpu")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe-rows needs a CUDA GPU (row-wise FP8 GEMMs), found none")
    rows = [int(r) for r in args.rows.split(",")]
    results, started = [], time.perf_counter()
    for model in args.models.split(","):
        by_shape, refused = shapes(model)
        for (k, n, bias), paths in sorted(by_shape.items()):
            if k % 16 or n % 16:
                continue  # torchao leaves such layers alone
            errors = {r: run_shape(k, n, bias, r) for r in rows}
            named = sorted(p for p in paths if p in refused)
            bad = {r: e for r, e in errors.items() if e}
            facts = failure_facts(k, n, bias, errors) if bad else {}
            results.append({"model": model, "in": k, "out": n, "bias": bias, "layers": len(paths),
                            "example": paths[0], "refused_by_record": named, "errors": errors, **facts})
            print(f"[probe] {model} {k}->{n} bias={bias} ({len(paths)} layers, e.g. {paths[0]}): "
                  f"{'ok' if not bad else {r: e[:60] for r, e in bad.items()}} {facts or ''}"
                  f"{' (record refuses ' + ', '.join(named) + ')' if named else ''}")
    failing = [f"{r['model']} {r['in']}->{r['out']}" for r in results if any(r["errors"].values())]
    unneeded = [name for r in results for name in r["refused_by_record"] if not any(r["errors"].values())]
    summary = {"rows_tried": rows, "shapes": len(results), "failing_shapes": failing,
               "record_refuses_but_ran": unneeded, "seconds": round(time.perf_counter() - started, 1)}
    table = [{"model": r["model"], "in -> out": f"{r['in']} -> {r['out']}", "bias": r["bias"],
              "layers": r["layers"], "e.g.": r["example"], "record refuses": ", ".join(r["refused_by_record"]),
              **{f"M={m}": "ok" if r["errors"][m] is None else "FAILS: " + r["errors"][m][:60] for m in rows},
              "runs from M": r.get("runs_from_rows", ""),
              "without bias": next(("ran" if v is None else "FAILS" for key, v in r.items()
                                    if key.startswith("without_bias")), "")}
             for r in results]
    base = os.path.join(args.out_dir, f"fp8-rows-probe-{args.tag}")
    write_results(base, "fp8-rows-probe", results, summary, table_rows=table,
                  notes="torchao row-wise float8 linear (the peers' recipe and ours), random bf16 data, by shape "
                        "and row count M; FAILS quotes the error's first line.")
    print(f"[probe] wrote {base}.json / .md")
    return 0
