"""`xstage-dit calibrate`: measure the X-Stage numbers of this machine, print them, draw the plots.

    xstage-dit calibrate [--target auto|local|host|nvlink[,...]] [--quick|--full] [--out DIR] [--force]

Prints per target R, T_iss0 and Q with their fit errors and the validation errors, writes
``calibration.json`` and four PNGs to ``--out`` (issue time vs gap, period vs gap with the max law and
the naive sum, isolated issue time vs volume with the knee, zero-gap period vs volume) and stores the
result in the per-machine cache that the server loads at start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from xstage_dit.cli import UsageError

PLOTS = ("issue_vs_gap", "period_vs_gap", "isolated", "zero_gap_period")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("calibrate", help="measure remote-store issue/drain/capacity (X-Stage) on this machine",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="auto", help="auto (all available), local, host, nvlink, or a comma list")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="quick", action="store_true", default=True, help="start-up plan (default)")
    mode.add_argument("--full", dest="quick", action="store_false", help="the dense plan (slower, finer)")
    p.add_argument("--out", default="calibration-out", help="folder for calibration.json and the PNGs")
    p.add_argument("--device", type=int, default=None, help="CUDA device index (default: current)")
    p.add_argument("--producers", type=int, default=None, help="producers K (default: one per SM)")
    p.add_argument("--cache-dir", default=None, help="calibration cache folder (default: $XSTAGE_DIT_CACHE)")
    p.add_argument("--force", action="store_true", help="measure even when the cache matches this machine")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    p.add_argument("--prefix", default="calibration", help="file name prefix of the JSON and PNGs")
    p.set_defaults(func=run)
    return p


def _fmt(x, scale=1.0, digits=3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "inf"
    return f"{x * scale:.{digits}g}"


def format_table(result) -> str:
    """One row per target: R, T_iss0, Q with fit errors, and the validation MAPEs."""
    head = (f"{'target':<8} {'R GB/s':>9} {'fit%':>6} {'T_iss0 us':>10} {'fit%':>6} {'Q MiB':>7} {'fit%':>6} "
            f"{'MAPE iss%':>9} {'MAPE per%':>9} {'MAPE iso%':>9}  drain-limited")
    lines = [head, "-" * len(head)]
    for name, rep in result.reports.items():
        s, f, v = rep["summary"], rep["fit"], rep["validation"]
        r = _fmt(s["R_GBps"]) if s["drain_limited"] else f">={s['R_lower_bound_GBps']:.0f}"
        lines.append(
            f"{name:<8} {r:>9} {_fmt(f.get('R_rel_rms'), 100, 2):>6} {s['t_iss0_us']:>10.3f} "
            f"{_fmt(f.get('t_iss0_rel_rms'), 100, 2):>6} {_fmt(s['Q_MiB']):>7} {_fmt(f.get('Q_rel_rms'), 100, 2):>6} "
            f"{v['mape_issue_pct']:>9.2f} {v['mape_period_pct']:>9.2f} {_fmt(v['mape_isolated_pct'], 1, 3):>9}  "
            f"{'yes' if s['drain_limited'] else 'no (never backs up)'}")
    for name, rep in result.reports.items():
        for note in rep.get("notes", []):
            lines.append(f"note [{name}]: {note}")
    return "\n".join(lines)


def draw_plots(result, out_dir: Path, prefix: str = "calibration") -> list[Path]:
    """Four PNGs, one panel per target. Returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from xstage_dit.xstage import MIB, isolated_issue_time, issue_time, knee_volume, naive_period, period

    names = list(result.reports)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for plot in PLOTS:
        fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), squeeze=False)
        for ax, name in zip(axes[0], names):
            rep = result.reports[name]
            params = result.params[name]
            sweep = rep["sweep"]
            periodic = sweep["periodic"]
            aligned = bool(sweep.get("aligned_every_burst", False))
            # old free-running sweeps: staggered bursts never see Q at long gaps (fit_sweep predicts them so)
            gap_params = params if aligned else dataclasses.replace(params, capacity_bytes=math.inf)
            ax.set_title(f"{name} ({'drain-limited' if rep['drain_limited'] else 'never backs up'})")
            if plot in ("issue_vs_gap", "period_vs_gap"):
                key = "issue_s" if plot == "issue_vs_gap" else "period_s"
                for kib in sweep["gap_kib"]:
                    pts = sorted((r for r in periodic if r["bytes_per_producer"] == kib * 1024), key=lambda r: r["gap_s"])
                    if not pts:
                        continue
                    v = pts[0]["volume_bytes"]
                    gs = [max(r["gap_s"], 0.0) for r in pts]
                    line = ax.plot([g * 1e6 for g in gs], [r[key] * 1e6 for r in pts], "o", ms=4,
                                   label=f"{kib} KiB/producer (V={v / MIB:.1f} MiB)")[0]
                    grid = [max(gs) * i / 200 for i in range(201)]
                    law = issue_time if plot == "issue_vs_gap" else period
                    ax.plot([g * 1e6 for g in grid], [law(gap_params, v, g) * 1e6 for g in grid], "-",
                            color=line.get_color(), lw=1.2)
                    if plot == "period_vs_gap" and math.isfinite(params.drain_rate_Bps):
                        ax.plot([g * 1e6 for g in grid], [naive_period(params, v, g) * 1e6 for g in grid], ":",
                                color=line.get_color(), lw=1.0)
                ax.set_xlabel("gap G, measured: work + loop overhead (us)")
                ax.set_ylabel("issue time (us)" if key == "issue_s" else "period (us)")
                q_term = "min(G, Q/R)" if aligned else "G"
                ax.plot([], [], "k-", label="model: " + (f"max(T_iss0, V/R - {q_term})" if key == "issue_s"
                                                         else f"max(T_iss0, V/R - {q_term}) + G"))
                if plot == "period_vs_gap":
                    ax.plot([], [], "k:", label="naive sum T_iss0 + G + V/R")
            elif plot == "isolated":
                iso = sorted(sweep["isolated"], key=lambda r: r["volume_bytes"])
                vs = [r["volume_bytes"] for r in iso]
                ax.plot([v / MIB for v in vs], [r["issue_s"] * 1e6 for r in iso], "o", ms=4, label="measured")
                grid = [max(vs) * i / 300 for i in range(1, 301)]
                ax.plot([v / MIB for v in grid], [isolated_issue_time(params, v) * 1e6 for v in grid], "-",
                        label="model max(T_iss0, (V-Q)/R)")
                ax.plot([v / MIB for v in grid], [params.t_iss0(v) * 1e6 for v in grid], "--", lw=0.8, label="T_iss0(V)")
                vk = knee_volume(params)
                if math.isfinite(vk):
                    ax.axvline(vk / MIB, color="gray", ls=":", label=f"knee {vk / MIB:.2f} MiB (Q={params.capacity_bytes / MIB:.2f} MiB)")
                ax.set_xlabel("burst volume V (MiB)")
                ax.set_ylabel("isolated issue time (us)")
            else:
                zero = sorted((r for r in periodic if r["role"] == "zero"), key=lambda r: r["volume_bytes"])
                vs = [r["volume_bytes"] for r in zero]
                ax.plot([v / MIB for v in vs], [r["period_s"] * 1e6 for r in zero], "o", ms=4, label="measured")
                grid = [max(vs) * i / 300 for i in range(1, 301)]
                ax.plot([v / MIB for v in grid], [period(params, v, 0.0) * 1e6 for v in grid], "-",
                        label="model max(V/R, T_iss0)")
                if math.isfinite(params.drain_rate_Bps):
                    ax.plot([v / MIB for v in grid], [v / params.drain_rate_Bps * 1e6 for v in grid], ":",
                            label=f"V/R, R={params.drain_rate_Bps / 1e9:.1f} GB/s")
                ax.set_xlabel("burst volume V (MiB)")
                ax.set_ylabel("zero-gap period (us)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{prefix}-{plot}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def run(args: argparse.Namespace) -> int:
    from xstage_dit.calibration import CalibrationConfig, CalibrationUnavailable

    try:
        CalibrationConfig(target=args.target, num_producers=args.producers)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if args.producers is not None:
        # an explicit K never comes from a cache keyed on the default
        args.force = True
    try:
        result = _calibrate(args)
    except CalibrationUnavailable as exc:
        raise UsageError(str(exc)) from exc
    print(f"calibration ({result.source}, {'quick' if result.quick else 'full'}, {result.elapsed_s:.2f} s) "
          f"on {result.machine_key.get('gpu_name')}; cache: {result.path}")
    print(format_table(result))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.prefix}.json").write_text(json.dumps(result.to_json(), indent=1, default=float))
    if not args.no_plots and all("sweep" in r for r in result.reports.values()):
        for path in draw_plots(result, out, args.prefix):
            print(f"wrote {path}")
    return 0


def _calibrate(args):
    from xstage_dit.calibration import CalibrationConfig, load_or_calibrate, run_calibration

    if args.producers is not None:
        cfg = CalibrationConfig(target=args.target, quick=args.quick, num_producers=args.producers)
        res = run_calibration(args.device, cfg)
        return res
    return load_or_calibrate(args.device, quick=args.quick, target=args.target, cache_dir=args.cache_dir,
                             force=args.force)
