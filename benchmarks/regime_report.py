"""JSON, Markdown and the two plots of bench_xstage_regime.py: residual vs M with the predicted M* marked,
and MoE time vs lead with the model's predicted overhead."""

from __future__ import annotations

import json
from pathlib import Path


def _stem(data: dict) -> str:
    env = data["environment"]
    gpu = str(env.get("gpu") or "gpu").replace("NVIDIA ", "").replace(" ", "-").lower()
    return f"{gpu}-{str(env.get('git_commit') or 'unknown')[:7]}"


def markdown(data: dict) -> str:
    s, p, env = data["summary"], data["host_params"], data["environment"]
    lines = [
        "# X-Stage regime on one GPU: model vs kernels, host-pinned target",
        "",
        f"{env.get('gpu')}, driver {env.get('driver')}, torch {env.get('torch')}, triton {env.get('triton')}; "
        f"commit {env.get('git_commit')}; {env.get('time_utc')}",
        "",
        f"Host target: R = {p['drain_rate_Bps'] / 1e9:.1f} GB/s, Q = {p['capacity_bytes'] / 2**20:.2f} MiB, "
        f"T_iss0 = {p['t_iss0_fixed_s'] * 1e6:.2f} us + V / {p['issue_rate_Bps'] / 1e9:.0f} GB/s "
        f"(K = {p['num_producers']}). KV-tile time {data['t_kv_tile_s'] * 1e6:.2f} us.",
        "",
        "## Attention (24 heads, d = 128, every output tile to the target)",
        "",
        "| M | local ms | fused->host ms | residual | predicted | gap us | G* us | design test | chosen | best |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["attention"]:
        verdict = "ok" if not r["predicted_backs_up"] else ("rate fails" if not r["rate_ok"] else "capacity fails")
        lines.append(f"| {r['seq_len']} | {r['ms_local']:.3f} | {r['ms_fused_host']:.3f} | {r['residual_us']:.0f} us "
                     f"({r['residual_pct']:+.1f} %) | {r['predicted_residual_us']:.0f} us | {r['gap_us']:.1f} | "
                     f"{r['recovery_gap_us']:.1f} | {verdict} | {r['chosen']} | {r['measured_best']} |")
    lines += ["", f"Design-test M* (both bounds hold from there on) = {s['attention_predicted_m_star']}; the model's "
              f"knee (predicted residual <= {s['attention_knee_pct']} %) = {s['attention_predicted_knee']}, measured knee = "
              f"{s['attention_measured_knee']} (within 25 %: {s['attention_knee_within_25pct']}); residual MAPE over backed-up points "
              f"{_pct(s['attention_residual_mape_backed_up_pct'])}; chooser agrees with the measured best at "
              f"{100 * s['attention_choice_agreement']:.0f} % of the points.", "",
              "## MoE expert MLP, combine rows to the target", "",
              "| shape | lead | local ms | host ms | overhead us | predicted us | gap us | backs up (model) |",
              "|---|---|---|---|---|---|---|---|"]
    for m in data["moe"]:
        for d in m["leads"]:
            lines.append(f"| {m['shape']} | {d['lead']} | {d['ms_local']:.3f} | {d['ms_host']:.3f} | {d['overhead_us']:.0f} | "
                         f"{d['predicted_overhead_us']:.0f} | {d['gap_us']:.2f} | {d['predicted_backs_up']} |")
    lines += ["", "| shape | rate bound (wave) | interleaved / wave | chosen lead | best lead | chosen / best |",
              "|---|---|---|---|---|---|"]
    for m in data["moe"]:
        ratio = "-" if m["chosen_over_best"] is None else f"{m['chosen_over_best']:.3f}"
        lines.append(f"| {m['shape']} | {'fails' if m['rate_bound_fails_wave'] else 'holds'} | "
                     f"{m['interleaved_over_wave']:.3f} | {m['chosen_lead']} | {m['best_lead']} | {ratio} |")
    lines += ["", f"MoE overhead MAPE over backed-up points {_pct(s['moe_overhead_mape_backed_up_pct'])}; interleaved "
              f"faster where the rate bound fails: {s['moe_interleaved_faster_where_rate_fails']}; not slower where it "
              f"holds: {s['moe_interleaved_not_slower_where_rate_holds']}; chosen lead within 10 % of the best: "
              f"{s['moe_chosen_lead_within_10pct']}.", ""]
    if data.get("notes"):
        lines += [data["notes"], ""]
    return "\n".join(lines)


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:.1f} %"


def plots(data: dict, stem: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ms = [r["seq_len"] for r in data["attention"]]
    ax.plot(ms, [r["residual_us"] for r in data["attention"]], "o-", label="measured residual (host - local)")
    ax.plot(ms, [r["predicted_residual_us"] for r in data["attention"]], "s--", label="model: issue overhead + tail")
    s = data["summary"]
    if s["attention_predicted_m_star"]:
        ax.axvline(s["attention_predicted_m_star"], color="k", ls=":", label=f"design-test M* = {s['attention_predicted_m_star']}")
    if s.get("attention_predicted_knee"):
        ax.axvline(s["attention_predicted_knee"], color="tab:orange", ls="-.",
                   label=f"model knee ({s['attention_knee_pct']} %) = {s['attention_predicted_knee']}")
    if s.get("attention_measured_knee"):
        ax.axvline(s["attention_measured_knee"], color="tab:blue", ls="--", alpha=0.5,
                   label=f"measured knee = {s['attention_measured_knee']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length M (tokens)")
    ax.set_ylabel("sender-side residual (us)")
    ax.set_title("Fused attention writing to host-pinned memory")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = stem.parent / f"{stem.name}-attention.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    out.append(path)

    fig, axes = plt.subplots(1, len(data["moe"]), figsize=(3.2 * len(data["moe"]), 3.6), squeeze=False)
    for ax, m in zip(axes[0], data["moe"]):
        leads = [d["lead"] for d in m["leads"]]
        ax.plot(leads, [d["ms_host"] for d in m["leads"]], "o-", label="host")
        ax.plot(leads, [d["ms_local"] for d in m["leads"]], "^-", label="local")
        ax.plot(leads, [d["ms_local"] + d["predicted_overhead_us"] / 1e3 for d in m["leads"]], "s--",
                label="local + predicted")
        ax.set_title(m["shape"], fontsize=9)
        ax.set_xlabel("lead (0 = wave)")
        ax.set_xticks(leads)
    axes[0][0].set_ylabel("ms")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path = stem.parent / f"{stem.name}-moe.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    out.append(path)
    return out


def write_report(out_dir: Path, data: dict) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / _stem(data)
    json_path = stem.parent / f"{stem.name}.json"
    json_path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    md_path = stem.parent / f"{stem.name}.md"
    md_path.write_text(markdown(data))
    return [json_path, md_path, *plots(data, stem)]
