"""What the end-to-end benchmark writes: rows with notes, the JSON + Markdown table (through
`xstage_dit.bench.results`) and the bar chart, rewritten after every contender (`Report`), and
``--rerender`` of an earlier results JSON."""

from __future__ import annotations

import json
import time
from pathlib import Path

from xstage_dit.bench.results import git_commit, write_results
from xstage_dit.bench.session import Bench, error_text
from xstage_dit.bench.stats import SERVED_OVER_BARE_TARGET, add_comparisons, build_summary
from xstage_dit.errors import UsageError


def verdict_cell(row: dict) -> str:
    """The table's verdict cell, e.g. 'same within noise (0.996x, 95% CI 0.990-1.002)'."""
    verdict, ratio, ci = row.get("verdict"), row.get("ratio_vs_diffusers"), row.get("ratio_ci95")
    if verdict is None or ratio is None:
        return verdict or ""
    if ci is None:
        return f"{verdict} ({ratio:.3f}x, one pair: no CI)"
    return f"{verdict} ({ratio:.3f}x, 95% CI {ci[0]:.3f}-{ci[1]:.3f})"


TABLE_COLUMNS = ("name", "status", "median_s", "p90_s", "transformer_step_ms", "peak_memory_gib",
                 "speedup_vs_diffusers_1gpu", "speedup_vs_diffusers_same_compile", "speedup_vs_xstage_serial",
                 "verdict", "output_max_abs_diff_vs_diffusers", "note")


def add_notes(rows: list[dict], settings: dict) -> None:
    """Each row's ``note`` (a table column): why it has no numbers, or what else it carries (compile
    mode, schedules, xfuser's degree-1 path, the baseline's drift, a contender that left the rounds
    early, the default-steps estimate)."""
    for r in rows:
        notes = []
        if r["status"] != "ok":
            notes.append(r.get("reason", ""))
        if r.get("resumed"):
            notes.append("measured by the earlier call this run resumed (--resume)")
        if r.get("transformer_output_finite") is False:
            notes.append("NON-FINITE: a timed transformer output held NaN or inf (its time is not comparable)")
        if r.get("round_failure"):
            notes.append(f"no later rounds after {r['round_failure']}")
        if r.get("compile_mode"):
            notes.append(f"compile: {r['compile_mode']}")
        if r.get("xfuser_naive_forward"):
            notes.append("xfuser at degree 1 runs the unmodified diffusers pipeline")
        if r.get("schedules"):
            notes.append("schedules: " + json.dumps(r["schedules"], ensure_ascii=False)[:300])
        if "baseline_drift_pct" in r:
            notes.append(f"drift {r['baseline_drift_pct']:+.1f}% by diffusers-repeat")
        if "baseline_round_spread_pct" in r:
            notes.append(f"round medians {', '.join(f'{m:.3f}' for m in r['round_medians_s'])} s "
                         f"(spread {r['baseline_round_spread_pct']:.1f}%)")
        if r.get("served_over_bare") is not None:
            notes.append(served_note(r))
        if r.get("step_cache"):
            c = r["step_cache"]
            notes.append(f"step cache: {c['computed']} {c['unit']} computed, {c['skipped']} skipped")
        if "latency_s_at_default_steps_extrapolated" in r:
            notes.append(f"{r['latency_s_at_default_steps_extrapolated']:.2f} s at {settings['default_steps']} "
                         "steps (extrapolated from the measured step time, not measured)")
        r["note"] = "; ".join(n for n in notes if n).replace("|", "/").replace("\n", " ")


def served_note(row: dict) -> str:
    """``served / bare 1.011x (95% CI 1.009-1.013, 24 pair(s) with xstage-calibrated): within 1.02``."""
    ratio, ci = row["served_over_bare"], row.get("served_over_bare_ci95")
    spread = f"95% CI {ci[0]:.3f}-{ci[1]:.3f}, " if ci else ""
    within = "within" if ratio <= SERVED_OVER_BARE_TARGET else "over"
    return (f"served / bare {ratio:.3f}x ({spread}{row['served_over_bare_pairs']} pair(s) with "
            f"{row['served_bare_row']}): {within} {SERVED_OVER_BARE_TARGET}")


def rounds_text(settings: dict) -> str:
    """How the eager group was ordered: interleaved rounds, or once each with the A/B/A repeat."""
    rounds = settings.get("rounds", 1)  # results written before --rounds existed: one round
    if rounds < 2:
        return ("diffusers-repeat: plain diffusers again after the eager xstage contenders (an A/B/A order), "
                "a second baseline the xstage rows pair with.")
    done = settings.get("rounds_completed", rounds)
    stopped = f", stopped by the {settings['rounds_stopped']}" if settings.get("rounds_stopped") else ""
    return (f"The eager diffusers and xstage contenders ran in {done} interleaved rounds ({rounds} requested"
            f"{stopped}): each round applies, warms up, times every prompt and undoes each of them, in an order "
            "rotated every round; median_s / p90_s are over all rounds and prompts. The torch.compile variants and "
            "the other stacks ran once, after them (compiling again every round would cost minutes).")


def notes_text(settings: dict) -> str:
    s = settings
    size = f"{s['height']}x{s['width']}" + (f", {s['frames']} frames" if s["kind"] == "video" else "")
    return "\n".join([
        f"Model {s['model']} ({s['family']}, {size}), **measured at {s['steps']} denoising steps** (model "
        f"default {s['default_steps']}), guidance {s['guidance']}, seed {s['seed']} (weights seed "
        f"{s.get('weights_seed', s['seed'])}), {s['dtype']}, "
        f"{s['gpus']} GPU(s); {s['num_prompts']} prompt(s) from xstage_dit/bench/prompts.txt per contender"
        f"{_repeats(s)}, each after {s['warmup']} warm-up run(s) of {s['warmup_steps']} step(s).",
        "",
        "median_s / p90_s: the whole pipeline call (text encoders, denoising, VAE decode), over every timed run. "
        "transformer_step_ms: CUDA events around every transformer forward, summed per denoising step "
        "(CFG pipelines run two forwards a step). peak_memory_gib: torch.cuda.max_memory_allocated, reset per "
        "contender. speedup_vs_diffusers_1gpu: plain diffusers on one GPU (eager) / contender; "
        "speedup_vs_xstage_serial: the difference the calibrated schedule makes. setup_s / warmup_s / "
        "dynamo_frames_setup_warmup / dynamo_frames_timed (JSON): applying, warming up (compiles land here), and "
        "the frames Dynamo converted in each (a timed frame is a recompile inside the timing); compile_s_setup_warmup "
        "(JSON): torch.compile's own timers over both, by phase (Dynamo tracing, AOTAutograd, Inductor, the wait on "
        "Triton's compile workers). text_encode_ms / transformer_ms / vae_decode_ms / other_ms (JSON): where a run's "
        "time goes, CUDA events around the text encoders', the transformer's and the VAE decoder's forwards and the "
        "rest of the call (medians over the runs). gc_pause_s_timed / cudnn_fp8_calls_timed (JSON): the garbage "
        "collector's pauses during the timed runs, and cuDNN FP8 attention's calls there by how they bound their "
        "operands (uid: by address; tensor: the slow first-call form; zeros: asked for, never ran). "
        "transformer_output_finite (JSON): every "
        "timed transformer output was finite; a row where one was not is marked NON-FINITE and left out of FP8's "
        "ratios (on NaN operands the GPU draws less power and runs faster). " + rounds_text(s),
        "",
        "served / bare (served rows' note): the geometric mean of the served row's latencies over the bare row's "
        "of the same configuration and compile setting (xstage-calibrated, else xstage-serial), paired by round, "
        "prompt and repeat, with its 95% t-interval, against issue 15's bound of "
        f"{SERVED_OVER_BARE_TARGET} (by the ratio itself).",
        "",
        "verdict (eager xstage rows): the geometric mean of the paired latency ratios xstage / diffusers (same "
        "round, same prompt; below 1 = faster) with its 95% t-interval; \"slower\" or \"faster\" only when the "
        "interval lies wholly above or below 1, else \"same within noise\". not_slower_than_diffusers (JSON): the "
        "verdict is not \"slower\".",
        "",
        f"Command: `{s['command']}`",
    ])


def bar_chart(rows: list[dict], settings: dict, gpu: str | None, path: Path) -> Path | None:
    """Median latency per measured contender, labelled with its speedup over plain diffusers on one GPU."""
    rows = [r for r in rows if r["status"] == "ok"]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    medians = [r["median_s"] for r in rows]
    colors = ["#1f77b4" if r["family"].startswith("xstage") else "#7f7f7f" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.5))
    bars = ax.bar(range(len(rows)), medians, color=colors)
    for bar, r in zip(bars, rows):
        speedup = r.get("speedup_vs_diffusers_1gpu")
        ax.annotate(f"{speedup:.2f}x" if speedup else "", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=9, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=20, ha="right")
    ax.set_ylabel("median end-to-end latency (s)")
    ax.set_title(f"{settings['model']}, {settings['gpus']}x {gpu or 'CPU'}, {settings['height']}x{settings['width']}, "
                 f"{settings['steps']} steps (label: speedup vs diffusers 1-GPU)", fontsize=9)
    ax.set_ylim(0, max(medians) * 1.15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(rows: list[dict], settings: dict, env: dict, stem: Path, chart: bool,
              extra: dict | None = None) -> list[Path]:
    """``<stem>.json`` + ``.md`` through the shared writer, and the bar chart ``<stem>.png``; ``extra``: more
    top-level keys of the JSON (``provenance``)."""
    add_notes(rows, settings)
    # The table's verdict cell carries the ratio and its interval; the JSON keeps them as separate fields.
    table_rows = [dict(r, verdict=verdict_cell(r)) if "verdict" in r else r for r in rows]
    paths = list(write_results(stem, "e2e", rows, build_summary(rows, settings), columns=TABLE_COLUMNS,
                               notes=notes_text(settings), env=env, table_rows=table_rows, extra=extra))
    if chart:
        png = bar_chart(rows, settings, env.get("gpu"), stem.parent / f"{stem.name}.png")
        if png is not None:
            paths.append(png)
    return paths


def _read_results(path: Path, option: str) -> dict:
    """A results JSON written by this benchmark (its environment, rows and summary.settings), or UsageError naming
    `option` and the path."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"expected {option} to be a results JSON written by xstage-dit bench, got {str(path)!r} "
                         f"({error_text(exc)})") from None
    settings = doc.get("summary", {}).get("settings") if isinstance(doc, dict) else None
    if not (isinstance(doc, dict) and doc.get("benchmark") == "e2e" and isinstance(doc.get("rows"), list)
            and isinstance(settings, dict) and isinstance(doc.get("environment"), dict)):
        raise UsageError(f"expected {option} to be a results JSON written by xstage-dit bench (benchmark 'e2e' with "
                         f"environment, rows and summary.settings), got {str(path)!r}")
    return doc


# What must match for a row of an earlier run to stand beside this run's rows (`resumed_rows`).
RESUME_SETTINGS = ("model", "gpus", "height", "width", "frames", "steps", "guidance", "seed", "weights_seed", "dtype",
                   "prompts", "repeats", "warmup", "warmup_steps", "input_images", "mask")
RESUME_ENVIRONMENT = ("gpu", "git_commit", "torch", "diffusers")


def resumed_rows(path: str | Path, settings: dict, env: dict) -> list[dict]:
    """The "ok" rows of the earlier run in `path` (the others are measured again), after checking that it ran
    the same `RESUME_SETTINGS` on the same GPU, commit and versions; UsageError naming the first difference."""
    path = Path(path)
    doc = _read_results(path, "--resume")
    before = doc["summary"]["settings"]
    for key in RESUME_SETTINGS:
        if before.get(key) != settings.get(key):
            raise UsageError(f"expected --resume {str(path)!r} to have run with this run's {key} "
                             f"{settings.get(key)!r}, got {before.get(key)!r}")
    for key in RESUME_ENVIRONMENT:
        if doc["environment"].get(key) != env.get(key):
            raise UsageError(f"expected --resume {str(path)!r} to come from this {key} {env.get(key)!r}, got "
                             f"{doc['environment'].get(key)!r}")
    return [dict(r, resumed=True) for r in doc["rows"] if r.get("status") == "ok"]


def rerender(path: str | Path) -> list[Path]:
    """Recompute the comparisons, verdicts, summary and notes of a results JSON written by this script with
    the current code, and rewrite its .json/.md/.png in place. Measures nothing: the measured fields
    (latencies, step times, memory), the settings and the environment stay as they are; the JSON's
    ``provenance.rerendered`` records the commit that recomputed them (earlier provenance is kept)."""
    path = Path(path)
    doc = _read_results(path, "--rerender")
    settings = doc["summary"]["settings"]
    rows = doc["rows"]
    add_comparisons(rows, settings["default_steps"], settings["steps"])
    extra = {k: v for k, v in doc.items() if k not in ("benchmark", "environment", "summary", "rows")}
    extra["provenance"] = dict(doc.get("provenance") or {}, rerendered={
        "at_commit": git_commit(), "what": "comparisons and verdicts recomputed from the measured latencies"})
    stem = path.parent / path.name.removesuffix(".json")
    return write_all(rows, settings, doc["environment"], stem, chart=True, extra=extra)


class Report:
    """The rows so far, in run order, and where they go: rank 0 prints every change and rewrites the JSON
    and the table, so a run cut short by a time limit still leaves what it measured."""

    def __init__(self, b: Bench, settings: dict, env: dict, stem: Path):
        self.b, self.settings, self.env, self.stem = b, settings, env, stem
        self.rows: list[dict] = []

    def row(self, name: str) -> dict | None:
        return next((r for r in self.rows if r["name"] == name), None)

    def put(self, row: dict, label: str | None = None) -> None:
        """Add ``row``, or replace the row of the same name (a contender measured in rounds, after each)."""
        names = [r["name"] for r in self.rows]
        if row["name"] in names:
            self.rows[names.index(row["name"])] = row
        else:
            self.rows.append(row)
        if self.b.rank == 0:
            detail = f"median {row['median_s']:.3f} s" if row["status"] == "ok" else row.get("reason", "")
            print(f"[bench] {label or row['name']}: {row['status']} {detail}", flush=True)
        self.write()

    def write(self, chart: bool = False) -> list[Path]:
        """Recompute the comparisons and rewrite the files (rank 0; the other ranks write nothing)."""
        if self.b.rank != 0:
            return []
        add_comparisons(self.rows, self.b.spec.steps, self.b.steps)
        self.settings["elapsed_s"] = time.perf_counter() - self.b.t_start
        return write_all(self.rows, self.settings, self.env, self.stem, chart=chart)

    def finish(self) -> None:
        for path in self.write(chart=True):
            print(f"[bench] wrote {path}", flush=True)


def _repeats(settings: dict) -> str:
    """", each timed N times in a row" where a run asked for --repeats N (older results have no such key)."""
    repeats = settings.get("repeats", 1)
    return f", each timed {repeats} times in a row" if repeats > 1 else ""
