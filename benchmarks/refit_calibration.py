"""Re-fit a calibration JSON's raw sweeps with the current ``fit_sweep`` (CPU only), and redraw its
table and plots. Used when the fit or the bookkeeping of a sweep point changed after a device run:
the measured data stay as they were, only the derivation is redone, and the file says so.

    python benchmarks/refit_calibration.py --raw RAW.json --out benchmarks/results --prefix calibration-h200-1gpu

A periodic record written by the run-2 code (``issue_s = period - gap work``) is converted to the
current bookkeeping (``issue_s``/``gap_s`` = the measured issue time and gap, ``gap_work_s`` = the
work's nominal time), exactly the fields ``calibration._periodic_point`` writes now.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def current_bookkeeping(sweep: dict) -> dict:
    sweep = copy.deepcopy(sweep)
    for r in sweep["periodic"]:
        if "issue_measured_s" in r:  # run-2 record
            r["gap_work_s"] = r["gap_s"]
            r["issue_s"] = r.pop("issue_measured_s")
            r["gap_s"] = r.pop("gap_measured_s")
    return sweep


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefix", default="calibration-h200-1gpu")
    args = ap.parse_args()

    from benchmarks.bench_calibration import markdown
    from xstage_dit.calibration.runner import CalibrationResult, fit_sweep
    from xstage_dit.cli.calibrate import draw_plots, format_table

    raw = json.loads(Path(args.raw).read_text())
    params, reports = {}, {}
    for name, rep_raw in raw["targets"].items():
        sweep = current_bookkeeping(rep_raw["sweep"])
        rep = fit_sweep(sweep)
        params[name] = rep.pop("params")
        rep["sweep"] = sweep
        rep["params"] = params[name].to_dict()
        reports[name] = rep
    res = CalibrationResult(params, raw["machine_key"], "measured", reports, raw.get("elapsed_s", 0.0), quick=False)
    print(format_table(res))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    doc = {"summary": dict(res.summary())}
    for key in ("quick_calibration_s", "cache_load_ms", "nvlink"):
        if key in raw.get("summary", {}):
            doc["summary"][key] = raw["summary"][key]
    doc["provenance"] = {
        "measured": f"on the device at commit {raw['env']['git_commit']} ({raw['env']['date_utc']}); raw file "
                    f"{Path(args.raw).name}",
        "fitted": f"offline with fit_sweep at commit {commit or 'unknown'} from the same raw sweep data",
        "bookkeeping": "issue_s/gap_s = measured issue time and gap (the run-2 code used issue = period - gap "
                       "work, which failed the T_iss0 fit: see the raw file's targets.host.fit)",
    }
    doc["env"] = raw["env"]
    doc.update(res.to_json())
    doc["full_calibration_s"] = raw.get("full_calibration_s")
    if "peer_shared_gpu" in raw:
        doc["peer_shared_gpu"] = dict(raw["peer_shared_gpu"], fit_note="fitted on the device with the run-2 "
                                      "bookkeeping (issue = period - gap work); its raw sweep was not kept")
    out = Path(args.out)
    (out / f"{args.prefix}.json").write_text(json.dumps(doc, indent=1, default=float))
    info = dict(raw["env"], git_commit=f"{raw['env']['git_commit']} (measured), {commit} (fitted)")
    (out / f"{args.prefix}.md").write_text(markdown(doc["summary"], info, args.prefix))
    for p in draw_plots(res, out, args.prefix):
        print(f"wrote {p}")
    print(json.dumps(doc["summary"], indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
