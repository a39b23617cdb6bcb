#!/usr/bin/env python3
"""The X-Stage regime on one GPU: the model's predictions against the kernels, with a slow remote target.

Host-pinned memory reached over PCIe is a real post-issue stage with a drain rate ~100x below HBM, so the
fused kernels back up the way DESIGN §2 predicts for a slow interconnect. This is a measurement mode of the
benchmark only (the pointer tables hold host-mapped addresses), never a serving path. One run:

1. calibrate the ``host`` target (full sweep; T_iss0, R, Q);
2. attention (bf16, d=128, b_m=b_n=128): our Triton kernel writing every output tile locally vs into pinned
   host memory, over M = 1K..32K tokens; the sender-side residual (host minus local, interleaved rounds);
   the per-KV-tile time from the local timing; the predicted threshold M* (the smallest M whose burst passes
   the design test) against the measured knee (the smallest M from which the residual stays under
   ``--knee-pct``); the serial alternative (local kernel + a copy to the host) and what
   ``choose_attention_schedule`` picks per point;
3. MoE: the fused expert MLP with its combine rows sent to host memory, leads 0 (wave) .. 4 (interleaved),
   at shapes where the model says the rate bound fails and where it holds; measured overhead (host minus
   local at the same lead) against the model's predicted issue overhead; the lead ``choose_moe_lead`` picks
   against the best measured lead.

    python benchmarks/bench_xstage_regime.py --out-dir benchmarks/results/xstage-regime

Writes ``<gpu>-<commit>.json`` / ``.md`` and ``-attention.png`` / ``-moe.png`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import environment, interleaved_times, time_ms  # noqa: E402
from benchmarks.regime_model import attention_prediction, moe_prediction, predicted_knee, predicted_threshold  # noqa: E402

ATTN_M = (1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768)
ATTN_HEADS = 24
HEAD_DIM = 128
BLOCK = 128
# MoE shapes: (name, hidden, intermediate, experts_per_rank, rows_per_expert). Small intermediates leave a
# short Linear-2 gap (rate bound fails for the host's R); HiDream's large expert holds it.
MOE_SHAPES = (
    ("nucleusmoe", 2048, 1344, 32, 256),
    ("inter-512", 2048, 512, 32, 256),
    ("inter-2688", 2048, 2688, 16, 256),
    ("hidream", 2560, 6912, 2, 2048),
)
LEADS = (0, 1, 2, 3, 4)


def _median_ms(fn, reps: int) -> float:
    return time_ms(fn, warmup=2, reps=reps)["median_ms"]


def calibrate_host(device: torch.device, quick: bool):
    from xstage_dit.calibration import CalibrationConfig, run_calibration

    result = run_calibration(device, CalibrationConfig(target="host", quick=quick))
    return result.params["host"], result


def _pinned_like(t: torch.Tensor) -> torch.Tensor:
    # Pinned (cudaHostAlloc) memory is mapped into the GPU's address space under UVA: its host address is
    # a valid device address, which is what the kernels' pointer tables hold.
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


def attention_point(seq_len: int, heads: int, params, facts, rounds: int, reps: int) -> dict:
    from xstage_dit.ops.attention.table import attention_to_buffers
    from xstage_dit.schedule import choose_attention_schedule

    dev = torch.device("cuda")
    q, k, v = (torch.randn(1, seq_len, heads, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(3))
    local = torch.empty_like(q)
    host = _pinned_like(q)
    t_local = torch.tensor([local.data_ptr()], dtype=torch.int64, device=dev)
    t_host = torch.tensor([host.data_ptr()], dtype=torch.int64, device=dev)
    kw = dict(seq_len=seq_len, seq_local=seq_len, head_offset=0)
    fns = {
        "local": lambda: attention_to_buffers(q, k, v, t_local, local, **kw),
        "host": lambda: attention_to_buffers(q, k, v, t_host, local, **kw),
        "serial": lambda: (attention_to_buffers(q, k, v, t_local, local, **kw), host.copy_(local, non_blocking=True)),
    }
    for fn in fns.values():  # compile once, check that the host copy is the local one
        fn()
    torch.cuda.synchronize()
    assert torch.equal(host, local.cpu()), f"host-written attention differs from local at M={seq_len}"
    times = interleaved_times(fns, lambda fn: _median_ms(fn, reps), rounds=rounds)
    ms = {name: statistics.median(ts) for name, ts in times.items()}
    pred = attention_prediction(params, facts, batch=1, seq_len=seq_len, heads=heads, head_dim=HEAD_DIM,
                                block=BLOCK, dtype_bytes=2, t_local_s=ms["local"] * 1e-3)
    # The schedule code on the same calibrated params, at a world size that asks it the real question
    # (world 1 needs no All-to-All): its verdict on this burst and gap.
    choice = choose_attention_schedule(params, facts=facts, batch=1, seq_len=seq_len, heads=heads,
                                       head_dim=HEAD_DIM, world_size=2, dtype_bytes=q.element_size(),
                                       t_kv_tile_s=pred["t_kv_tile_s"])
    best = "fused" if ms["host"] <= ms["serial"] else "serial"
    return {
        "seq_len": seq_len, "heads": heads,
        "ms_local": ms["local"], "ms_fused_host": ms["host"], "ms_serial_host": ms["serial"],
        "ms_rounds": times,
        "residual_us": (ms["host"] - ms["local"]) * 1e3,
        "residual_pct": 100.0 * (ms["host"] / ms["local"] - 1.0),
        **pred,
        "chosen": choice.name, "chosen_reason": choice.reason, "measured_best": best,
        "choice_agrees": choice.name == best,
    }


def _moe_inputs(hidden: int, inter: int, experts: int, rows_per_expert: int):
    dev = torch.device("cuda")
    rows = experts * rows_per_expert
    x = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
    gate_up = torch.randn(experts, hidden, 2 * inter, device=dev, dtype=torch.bfloat16) * hidden**-0.5
    down = torch.randn(experts, inter, hidden, device=dev, dtype=torch.bfloat16) * inter**-0.5
    offsets = [e * rows_per_expert for e in range(experts + 1)]
    weight = torch.rand(rows, device=dev, dtype=torch.float32)
    dest_rank = torch.zeros(rows, dtype=torch.int32, device=dev)
    dest_row = torch.randperm(rows, device=dev).to(torch.int32)
    return x, gate_up, down, offsets, weight, dest_rank, dest_row


def moe_point(name: str, hidden: int, inter: int, experts: int, rows_per_expert: int, params, facts,
              rounds: int, reps: int) -> dict:
    from xstage_dit.ops.moe import MoEKernelConfig, expert_mlp_combine
    from xstage_dit.schedule.moe import choose_moe_lead

    x, gate_up, down, offsets, weight, dest_rank, dest_row = _moe_inputs(hidden, inter, experts, rows_per_expert)
    rows = x.shape[0]
    local = torch.empty(rows, hidden, device=x.device, dtype=x.dtype)
    host = torch.empty(rows, hidden, dtype=x.dtype, pin_memory=True)
    tables = {"local": torch.tensor([local.data_ptr()], dtype=torch.int64, device=x.device),
              "host": torch.tensor([host.data_ptr()], dtype=torch.int64, device=x.device)}
    h_buffer = torch.empty(rows, inter, device=x.device, dtype=x.dtype)

    def run(target: str, lead: int):
        return expert_mlp_combine(x, gate_up, down, offsets, weight, dest_rank, dest_row, tables[target],
                                  lead=lead, h_buffer=h_buffer)

    fns = {f"{t}/lead{d}": (lambda t=t, d=d: run(t, d)) for d in LEADS for t in ("local", "host")}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    assert torch.equal(host, local.cpu()), f"host-written combine rows differ from local ({name})"
    times = interleaved_times(fns, lambda fn: _median_ms(fn, reps), rounds=rounds)
    ms = {key: statistics.median(ts) for key, ts in times.items()}
    cfg = MoEKernelConfig()  # the tiles expert_mlp_combine runs without a config
    choice = choose_moe_lead(params, facts, hidden=hidden, intermediate=inter, rows_per_expert=rows_per_expert,
                             num_experts_per_rank=experts, dtype_bytes=x.element_size(), block_m=cfg.block_m,
                             block_n1=cfg.block_n1, block_n2=cfg.block_n2)
    leads = []
    for d in LEADS:
        pred = moe_prediction(params, facts, hidden=hidden, intermediate=inter, experts=experts,
                              rows_per_expert=rows_per_expert, lead=d, t_local_s=ms[f"local/lead{d}"] * 1e-3)
        leads.append({"lead": d, "ms_local": ms[f"local/lead{d}"], "ms_host": ms[f"host/lead{d}"],
                      "overhead_us": (ms[f"host/lead{d}"] - ms[f"local/lead{d}"]) * 1e3, **pred})
    best = min(leads, key=lambda r: r["ms_host"])
    chosen_lead = int(choice.params["lead"])
    chosen = next(r for r in leads if r["lead"] == chosen_lead) if chosen_lead in LEADS else None
    wave = leads[0]
    inter_best = min(leads[1:], key=lambda r: r["ms_host"])
    return {
        "shape": name, "hidden": hidden, "intermediate": inter, "experts": experts, "rows_per_expert": rows_per_expert,
        "leads": leads, "ms_rounds": times,
        "rate_bound_fails_wave": wave["rate_bound_fails"],
        "interleaved_over_wave": inter_best["ms_host"] / wave["ms_host"],
        "chosen": choice.name, "chosen_lead": chosen_lead, "chosen_reason": choice.reason,
        "best_lead": best["lead"],
        "chosen_over_best": (chosen["ms_host"] / best["ms_host"]) if chosen else None,
    }


def summarize(attn: list[dict], moe: list[dict], knee_pct: float, m_star: dict) -> dict:
    from benchmarks.regime_model import measured_knee, mape

    knee = measured_knee(attn, knee_pct)
    backed = [(r["predicted_residual_us"], r["residual_us"]) for r in attn if r["predicted_backs_up"]]
    moe_backed = [(d["predicted_overhead_us"], d["overhead_us"]) for m in moe for d in m["leads"] if d["predicted_backs_up"]]
    rate_fail = [m for m in moe if m["rate_bound_fails_wave"]]
    rate_hold = [m for m in moe if not m["rate_bound_fails_wave"]]
    # M* of DESIGN §2 is where both bounds of the design test hold; where the capacity bound fails at every M
    # (an aligned full-wave burst a little over Q), the model's knee is where its predicted cost falls under
    # knee_pct: the one comparable with the measured knee.
    predicted = m_star["residual_under_knee_pct"]
    return {
        "attention_predicted_m_star": m_star["design_test"],
        "attention_predicted_knee": predicted,
        "attention_measured_knee": knee,
        "attention_knee_pct": knee_pct,
        "attention_knee_within_25pct": (predicted is not None and knee is not None and abs(knee - predicted) <= 0.25 * predicted),
        "attention_residual_mape_backed_up_pct": mape(backed),
        "attention_choice_agreement": sum(r["choice_agrees"] for r in attn) / len(attn),
        "moe_overhead_mape_backed_up_pct": mape(moe_backed),
        "moe_interleaved_faster_where_rate_fails": all(m["interleaved_over_wave"] < 1.0 for m in rate_fail) if rate_fail else None,
        "moe_interleaved_not_slower_where_rate_holds": all(m["interleaved_over_wave"] <= 1.02 for m in rate_hold) if rate_hold else None,
        "moe_chosen_lead_within_10pct": all(m["chosen_over_best"] is not None and m["chosen_over_best"] <= 1.10 for m in moe),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/xstage-regime"))
    parser.add_argument("--quick", action="store_true", help="quick calibration and fewer points (a smoke run)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--knee-pct", type=float, default=2.0, help="residual (%%) below which attention is 'free'")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_xstage_regime: needs a CUDA GPU", file=sys.stderr)
        return 2
    from benchmarks.regime_report import write_report
    from xstage_dit.schedule.facts import DeviceFacts

    device = torch.device("cuda", torch.cuda.current_device())
    facts = DeviceFacts.from_device(device)
    env = environment()
    params, cal = calibrate_host(device, args.quick)
    print(f"host target: R={params.drain_rate_Bps / 1e9:.1f} GB/s Q={params.capacity_bytes / 2**20:.2f} MiB "
          f"T_iss0 fixed {params.t_iss0_fixed_s * 1e6:.2f} us", flush=True)
    seqs = ATTN_M[::2] if args.quick else ATTN_M
    attn = []
    for m in seqs:
        attn.append(attention_point(m, ATTN_HEADS, params, facts, args.rounds, args.reps))
        r = attn[-1]
        print(f"attention M={m}: local {r['ms_local']:.3f} ms, host {r['ms_fused_host']:.3f} ms "
              f"({r['residual_pct']:+.1f} %), predicted {r['predicted_residual_us']:.0f} us", flush=True)
    moe = []
    for shape in (MOE_SHAPES[:2] if args.quick else MOE_SHAPES):
        moe.append(moe_point(*shape, params, facts, args.rounds, args.reps))
        m = moe[-1]
        print(f"moe {m['shape']}: interleaved/wave {m['interleaved_over_wave']:.3f}, chosen lead {m['chosen_lead']}, "
              f"best {m['best_lead']}", flush=True)
    # The KV-tile time is a property of the kernel, not of M: its median over the points with several
    # waves (short sequences are launch-dominated) gives the M* of the model.
    t_kv = statistics.median(r["t_kv_tile_s"] for r in attn if r["seq_len"] >= 4096)
    geometry = dict(batch=1, heads=ATTN_HEADS, head_dim=HEAD_DIM, block=BLOCK, dtype_bytes=2, t_kv_tile_s=t_kv)
    m_star = {"design_test": predicted_threshold(params, facts, **geometry),
              "residual_under_knee_pct": predicted_knee(params, facts, pct=args.knee_pct, **geometry)}
    data = {"benchmark": "xstage-regime", "environment": env, "device_facts": facts.__dict__,
            "host_params": params.to_dict(), "calibration_summary": cal.summary(),
            "attention": attn, "moe": moe, "t_kv_tile_s": t_kv,
            "summary": summarize(attn, moe, args.knee_pct, m_star)}
    paths = write_report(args.out_dir, data)
    print(json.dumps(data["summary"], indent=1))
    print("wrote", ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
