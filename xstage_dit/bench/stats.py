"""The numbers of the end-to-end benchmark: percentiles, paired latency ratios with a 95% interval of
their geometric mean and its verdict, and the comparisons and summary derived from the measured rows."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

from xstage_dit.bench.options import BASELINE, BASELINE_REPEAT


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("expected at least one value, got none")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (scipy is not a dependency); past 30
# the normal quantile 1.96 (at most 4% narrower than t's).
T95_TWO_SIDED = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
                 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
                 2.052, 2.048, 2.045, 2.042)


def t95(df: int) -> float:
    """Two-sided 95% quantile of Student's t with ``df`` >= 1 degrees of freedom (1.96 past 30)."""
    if df < 1:
        raise ValueError(f"expected df >= 1, got {df}")
    return T95_TWO_SIDED[df - 1] if df <= len(T95_TWO_SIDED) else 1.96


def ratio_verdict(ratios: Sequence[float]) -> dict:
    """Is a contender slower than the baseline? From paired latency ratios r_i = x_i / base_i.

    The log ratios' mean m and standard error s/sqrt(n) give the 95% t-interval exp(m ± t95(n-1)·s/sqrt(n))
    of the geometric-mean ratio: "slower" when it lies wholly above 1, "faster" wholly below 1, else "same
    within noise"; "one pair: no verdict" with a single pair (no spread, so no noise to compare with);
    "not measured" without pairs. Logs, because latencies scale: 1.1 and 1/1.1 cancel.

    Returns ``{"ratio": geometric mean | None, "ci95": [lo, hi] | None, "verdict": str, "pairs": n}``.

    Example::

        ratio_verdict([1.01, 0.99, 1.00])["verdict"]   # 'same within noise' (ci95 ~ [0.975, 1.025])
        ratio_verdict([1.10, 1.11, 1.09])["verdict"]   # 'slower'
    """
    if any(not (math.isfinite(r) and r > 0) for r in ratios):
        raise ValueError(f"expected positive finite latency ratios, got {list(ratios)}")
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    if n == 0:
        return {"ratio": None, "ci95": None, "verdict": "not measured", "pairs": 0}
    mean = statistics.fmean(logs)
    if n == 1:
        return {"ratio": math.exp(mean), "ci95": None, "verdict": "one pair: no verdict", "pairs": 1}
    half = t95(n - 1) * statistics.stdev(logs) / math.sqrt(n)
    lo, hi = math.exp(mean - half), math.exp(mean + half)
    verdict = "slower" if lo > 1 else "faster" if hi < 1 else "same within noise"
    return {"ratio": math.exp(mean), "ci95": [lo, hi], "verdict": verdict, "pairs": n}


def paired_ratios(row: dict, baselines: Sequence[dict]) -> list[float]:
    """``x_i / base_i`` for every sample i that ``row`` shares with the baseline rows, in order.

    Rows keep their samples round by round, prompt by prompt, so index i is the same (round, prompt) in
    both; a contender that left the rounds early pairs the rounds it has. With several baselines (at one
    round: diffusers before and diffusers-repeat after, an A/B/A bracket) base_i is their geometric mean:
    one pair per sample, since pairing one xstage sample with each baseline would count it twice and
    narrow the interval without any new measurement.
    """
    latencies = row.get("latencies_s") or []
    series = [baseline.get("latencies_s") or [] for baseline in baselines]
    if not series:
        return []
    n = min([len(latencies)] + [len(s) for s in series])
    return [latencies[i] / math.exp(statistics.fmean(math.log(s[i]) for s in series)) for i in range(n)]


# What add_comparisons derives from the measured fields. Cleared before it runs, so it can run again on rows
# it has seen (after every contender, and on --rerender) without leaving a stale value behind.
DERIVED_FIELDS = ("speedup_vs_diffusers_1gpu", "speedup_vs_diffusers_same_compile", "speedup_vs_xstage_serial",
                  "baseline_drift_pct", "baseline_round_spread_pct", "ratio_vs_diffusers", "ratio_ci95",
                  "ratio_pairs", "verdict", "not_slower_than_diffusers", "latency_s_at_default_steps_extrapolated",
                  "served_over_bare", "served_over_bare_ci95", "served_over_bare_pairs", "served_bare_row")

#: Issue 15's bound on what serving may add: a served request at most this many times the bare call.
SERVED_OVER_BARE_TARGET = 1.02
#: The bare row a served row is compared with: the same configuration (`xstage-served` is `xstage-calibrated`
#: behind the server), else the serial schedule (the same at world 1 but for the attention kernel's choice).
SERVED_BARE_ROWS = {"xstage-served": ("xstage-calibrated", "xstage-serial"), "xstage-fp8-served": ("xstage-fp8",),
                    "xstage-fp8-attn-served": ("xstage-fp8-attn",)}


def add_comparisons(rows: list[dict], default_steps: int, steps: int) -> None:
    """Ratios of measured medians: against plain diffusers on one GPU (eager: the headline), against
    diffusers with the same compile setting, and calibrated against serial (the difference the
    calibrated schedule makes); the baseline's drift over the run; for each eager xstage row the
    noise-aware verdict against diffusers (``ratio_verdict`` of ``paired_ratios``); plus a labelled
    estimate at the model's default step count."""
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        for key in DERIVED_FIELDS:
            r.pop(key, None)

    def ok_row(name: str) -> dict | None:
        r = by_name.get(name)
        return r if r is not None and r.get("status") == "ok" else None

    def median_of(name: str) -> float | None:
        r = ok_row(name)
        return r["median_s"] if r is not None else None

    base_row, repeat_row = ok_row(BASELINE), ok_row(BASELINE_REPEAT)
    base, repeat = median_of(BASELINE), median_of(BASELINE_REPEAT)
    if base and repeat:
        base_row["baseline_drift_pct"] = 100.0 * (repeat - base) / base
    round_medians = (base_row or {}).get("round_medians_s") or []
    if len(round_medians) >= 2:
        base_row["baseline_round_spread_pct"] = (
            100.0 * (max(round_medians) - min(round_medians)) / statistics.median(round_medians))
    for r in rows:
        if r.get("status") != "ok":
            continue
        # "", "+compile" or "+compile:<mode>" (a --compile-also variant): the same compile's baseline rows
        suffix = r["name"][len(r["family"]):] if r["name"].startswith(r["family"]) else ""
        same, serial = median_of(BASELINE + suffix), median_of("xstage-serial" + suffix)
        r["speedup_vs_diffusers_1gpu"] = base / r["median_s"] if base else None
        r["speedup_vs_diffusers_same_compile"] = same / r["median_s"] if same else None
        if r["family"] == "xstage-calibrated":
            r["speedup_vs_xstage_serial"] = serial / r["median_s"] if serial else None
        if r["family"].startswith("xstage") and not r["compile"] and base_row is not None:
            # Paired with the diffusers runs of the same round and prompt (at one round: the run before and
            # the repeat after), so drift over the run cancels instead of reading as a speedup.
            stats = ratio_verdict(paired_ratios(r, [x for x in (base_row, repeat_row) if x is not None]))
            r.update(ratio_vs_diffusers=stats["ratio"], ratio_ci95=stats["ci95"], ratio_pairs=stats["pairs"],
                     verdict=stats["verdict"])
            if stats["pairs"] >= 2:  # one pair has no spread: no claim either way
                r["not_slower_than_diffusers"] = stats["verdict"] != "slower"
        if r["family"] in SERVED_BARE_ROWS:
            _served_over_bare(r, [row for row in (ok_row(name + suffix) for name in SERVED_BARE_ROWS[r["family"]])
                                  if row])
        if steps != default_steps:
            # Not measured: the measured latency plus the missing steps at the measured step time.
            r["latency_s_at_default_steps_extrapolated"] = (
                r["median_s"] + (default_steps - steps) * r["transformer_step_ms"] / 1e3)


def _served_over_bare(row: dict, bare_rows: list[dict]) -> None:
    """What the server costs: the served row's latencies over the first of `bare_rows` (same compile setting)
    that has samples to pair, paired as `paired_ratios` pairs (same round, prompt and repeat; in interleaved
    rounds a slow spell of the machine then lands in both), as the geometric mean with its 95 % interval."""
    for bare in bare_rows:
        pairs = paired_ratios(row, [bare])
        if pairs:
            stats = ratio_verdict(pairs)
            row.update(served_over_bare=stats["ratio"], served_over_bare_ci95=stats["ci95"],
                       served_over_bare_pairs=stats["pairs"], served_bare_row=bare["name"])
            return


def build_summary(rows: list[dict], settings: dict) -> dict:
    """Headline figures: per contender its status, median latency (s) and speedup over plain diffusers
    on one GPU (and, where present, the baseline's drift and the eager xstage rows' verdicts); with the
    settings they were measured at."""
    contenders = {}
    for r in rows:
        if r["status"] == "ok":
            contenders[r["name"]] = {"status": "ok", "median_latency_s": r["median_s"],
                                     "speedup_vs_diffusers_1gpu": r.get("speedup_vs_diffusers_1gpu")}
            for key in ("baseline_drift_pct", "baseline_round_spread_pct", "not_slower_than_diffusers", "verdict",
                        "ratio_vs_diffusers", "ratio_ci95", "served_over_bare", "served_over_bare_ci95"):
                if key in r:
                    contenders[r["name"]][key] = r[key]
        else:
            contenders[r["name"]] = {"status": r["status"], "reason": r.get("reason", "")}
    summary = {"baseline": BASELINE, "measured_at_steps": settings["steps"], "contenders": contenders,
               "settings": settings}
    fp8 = _fp8_ratios(rows)
    if fp8:
        summary["fp8"] = fp8
    cached = _cache_ratios(rows)
    if cached:
        summary["step_cache"] = cached
    return summary


def _cache_ratios(rows: list[dict]) -> dict:
    """Per forced ratio and compile setting ("@1/4", "@1/4+compile"): each xstage cache method's median latency and
    computed count, cache-dit's at the same ratio, and xstage First Block Cache over cache-dit (the same computed
    steps, one first block on a skipped step in both)."""
    ok = {r["name"]: r for r in rows if r.get("status") == "ok" and r.get("step_cache")}
    out: dict = {}
    for name, r in ok.items():
        if not name.startswith("xstage-cache:"):
            continue
        method, _, rest = name[len("xstage-cache:"):].partition("@")
        key = "@" + rest
        entry = out.setdefault(key, {"methods": {}})
        entry["methods"][method] = {"median_s": r["median_s"], **{k: r["step_cache"][k] for k in
                                                                   ("unit", "computed", "skipped")}}
        peer = ok.get("cache-dit" + key)
        if peer is not None:
            entry["cache_dit"] = {"median_s": peer["median_s"], "computed": peer["step_cache"]["computed"]}
            if method == "fbcache":
                entry["fbcache_over_cache_dit"] = r["median_s"] / peer["median_s"]
    return out


def _fp8_ratios(rows: list[dict]) -> dict:
    """Per compile setting ("eager", "+compile", "+compile:<mode>"): fp8_over_bf16 (xstage FP8 over xstage bf16:
    the served rows where both were measured, else the bare ones) and fp8_over_peer_fp8 (xstage FP8, served else
    bare, over diffusers + torchao FP8), each a ratio of median latencies; None where a row is missing. Where the
    FP8-attention rows ran, fp8_attn_over_bf16 / fp8_attn_over_peer_fp8 the same for them, and fp8_attn_over_fp8
    (FP8 attention over FP8 linear layers alone: what the 8-bit attention kernels add). A row whose transformer
    output went non-finite counts as missing (NaN operands run faster: `bench.finite`); ``nonfinite_rows`` names
    those of a setting."""
    ok = [r for r in rows if r.get("status") == "ok"]
    median = {r["name"]: r["median_s"] for r in ok if r.get("transformer_output_finite", True)}
    nonfinite = [r for r in ok if r.get("transformer_output_finite") is False]
    families = ("xstage-fp8", "xstage-fp8-served", "xstage-fp8-attn", "xstage-fp8-attn-served")
    suffixes = {r["name"][len(r["family"]):] for r in ok if r["family"] in families}
    out = {}
    for suffix in sorted(suffixes):
        bf16 = [median.get("xstage-served" + suffix), median.get("xstage-calibrated" + suffix)]
        peer = median.get("diffusers-fp8" + suffix)
        entry = {}
        for label, prefix in (("fp8", "xstage-fp8"), ("fp8_attn", "xstage-fp8-attn")):
            served, bare = median.get(prefix + "-served" + suffix), median.get(prefix + suffix)
            if label == "fp8_attn" and served is None and bare is None:
                continue
            pairs = [(served, bf16[0]), (bare, bf16[1])]
            entry[f"{label}_over_bf16"] = next((a / b for a, b in pairs if a and b), None)
            entry[f"{label}_over_peer_fp8"] = (served or bare) / peer if peer and (served or bare) else None
        if "fp8_attn_over_bf16" in entry:
            pairs = [(median.get(f"xstage-fp8-attn{kind}" + suffix), median.get(f"xstage-fp8{kind}" + suffix))
                     for kind in ("-served", "")]
            entry["fp8_attn_over_fp8"] = next((a / b for a, b in pairs if a and b), None)
        left_out = [r["name"] for r in nonfinite if r["name"][len(r["family"]):] == suffix
                    and r["family"] in ("diffusers-fp8", "xstage-served", "xstage-calibrated") + families]
        if left_out:
            entry["nonfinite_rows"] = left_out
        out[suffix or "eager"] = entry
    return out
