"""The peer-window rows of ``bench_attention_a2a.py --window`` (issue 14's table), on one GPU.

For every (S, H, P) two scopes, each timed in interleaved rounds in one process (bf16, D=128, B=1):

- ``rank``: the shape one rank runs, Hr = H/P heads (the last rank, so its head offset in the window is
  not 0) over the whole sequence, writing the owners' buffers through a local peer window of P slots;
- ``all``: all H heads in one launch (the P ranks' work together) through the same window.

Columns (ms, and ratio to cuDNN = t_cudnn / t): ``cudnn`` (torch's cuDNN SDPA, same heads, local output),
``fa4`` (FA4 plain, local), ``fa4_window``, ``fa4m64`` / ``fa4m64_window`` (FA4 on 64-row tiles, only where
the window slots end in a half tile), ``fa4split_window`` (FA4's 128-row tiles, then the slots' half-tile
tails on 64-row tiles; residual against plain ``fa4``), ``fa4gqa_window`` (the owner blocks as GQA query heads
of one KV head, the rank's heads as the batch: FA4 packs the owners' rows into full tiles; residual against
plain ``fa4``), ``fa4gqaunpacked_window`` (the same launch unpacked, only where the slots fill whole 128-row
tiles; residual against plain ``fa4``), ``cudnn_window`` (cudnn-frontend with the window as O) and its
local twin ``cudnnfe_local``, ``triton_window`` (our kernel through the window's table) and ``triton_local``;
``serial`` = the best local kernel + a copy of its output into the owners' buffers (the post-A2A's bytes on
one GPU; NCCL refuses virtual ranks on one GPU). Residual of a kernel = t_window - t_local of that kernel;
FA4's is split by ``fa4_oblocal`` (the window path's launch, Q as P owner blocks and K/V a stride-0 batch,
into a local buffer): ``residual_fa4_layout_pct`` (that launch against plain FA4) and
``residual_fa4_stores_pct`` (the window's stores against that launch).
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F

from xstage_dit.comm.peer_window import PeerWindow
from xstage_dit.ops.attention.kernels import OutTarget, make_kernel
from xstage_dit.ops.attention.window import WindowGeometry, head_ranges

WINDOW_SHAPES = [(4608, 24, "FLUX 1024^2"), (4608, 40, "4608 tokens, 40 heads"), (8192, 24, "8K"), (8192, 40, "8K"),
                 (16384, 24, "16K"), (16384, 40, "16K, Wan heads"), (32768, 24, "32K"), (32768, 40, "32K, Wan heads"),
                 (65536, 24, "64K"), (65536, 40, "64K, Wan heads")]
WORLDS = (1, 2, 4, 8)
# The kernels writing through the window.
WINDOW_FNS = ("fa4_window", "fa4m64_window", "fa4split_window", "fa4gqa_window", "fa4gqaunpacked_window",
              "cudnn_window", "triton_window")


def _cudnn_sdpa(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def run():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(qt, kt, vt)

    return run


def _variants(seq, heads, world, scope, *, with_cudnn_fe: bool, odd_stride: bool = False):
    """{name: fn} for one row, plus the tensors they write (for the correctness check)."""
    d, dtype, dev = 128, torch.bfloat16, torch.device("cuda")
    length = -(-seq // world)
    ranges = head_ranges(heads, world)
    h0, hr = ranges[-1] if scope == "rank" else (0, heads)
    buf = torch.zeros((3, 1, world * length, hr, d), dtype=dtype, device=dev)
    buf[:, :, :seq].normal_()
    q, k, v = buf[0], buf[1], buf[2]
    qs, ks, vs = q[:, :seq], k[:, :seq], v[:, :seq]
    scale = d ** -0.5
    window = PeerWindow.local(world, 1, length * heads * d * 2, dev, odd_stride=odd_stride)
    geom = WindowGeometry(world, 1, seq, heads, d, window.slot_bytes // 2)
    spec = geom.out_view(0)
    view = window.view(dtype, (world, length, hr, d), spec.strides, h0 * d)
    target = OutTarget(view, window.owner_table(0), geom.table_strides(), h0)
    out_local = torch.empty((1, seq, hr, d), dtype=dtype, device=dev)
    fns = {"cudnn": _cudnn_sdpa(qs, ks, vs)}
    fa4 = make_kernel("fa4")
    if fa4.supports(geom, dtype, dev, True) is None:
        fns["fa4"] = lambda: fa4._impl.run_plain(qs, ks, vs, scale, out=out_local)
        fns["fa4_window"] = lambda: fa4.run(q, k, v, target, geom, scale)
        # The window path's launch (Q as P owner blocks, K/V a stride-0 batch) into a local buffer: splits the
        # residual into the launch's layout and the stores through the window.
        ob_local = torch.empty((world, length, hr, d), dtype=dtype, device=dev)
        fns["fa4_oblocal"] = lambda: fa4._impl.run(q, k, v, ob_local, geom, scale, kv_mode=fa4.kv_mode)
    half = make_kernel("fa4-m64")  # FA4 on 64-row tiles: only where the slots end in a half tile
    if half.supports(geom, dtype, dev, True) is None:
        fns["fa4m64"] = lambda: half._impl.run_plain(qs, ks, vs, scale, out=out_local)
        fns["fa4m64_window"] = lambda: half.run(q, k, v, target, geom, scale)
    split = make_kernel("fa4-split")  # FA4's 128-row tiles, then the half-tile tails on 64-row tiles
    if split.supports(geom, dtype, dev, True) is None:
        fns["fa4split_window"] = lambda: split.run(q, k, v, target, geom, scale)
    owners_as_heads = make_kernel("fa4-gqa")  # the owner blocks as GQA query heads: FA4 packs them into full tiles
    if owners_as_heads.supports(geom, dtype, dev, True) is None:
        fns["fa4gqa_window"] = lambda: owners_as_heads.run(q, k, v, target, geom, scale)
    unpacked = make_kernel("fa4-gqa-unpacked")  # the same launch unpacked: only where the slots fill whole tiles
    if unpacked.supports(geom, dtype, dev, True) is None:
        fns["fa4gqaunpacked_window"] = lambda: unpacked.run(q, k, v, target, geom, scale)
    triton = make_kernel("triton")
    local_geom = WindowGeometry(1, 1, seq, hr, d, seq * hr * d)
    local_target = OutTarget(None, torch.tensor([out_local.data_ptr()], dtype=torch.int64, device=dev),
                             (seq * hr * d, hr * d, d), 0)
    fns["triton_local"] = lambda: triton.run(q, k, v, local_target, local_geom, scale)
    fns["triton_window"] = lambda: triton.run(q, k, v, target, geom, scale)
    if with_cudnn_fe:
        cfe = make_kernel("cudnn")
        if cfe.supports(geom, dtype, dev, True) is None:
            local_view = out_local.view(1, seq, hr, d)
            lgeom = WindowGeometry(1, 1, seq, hr, d, seq * hr * d)
            fns["cudnnfe_local"] = lambda: cfe._impl.run(qs, ks, vs, local_view, lgeom, scale)
            fns["cudnn_window"] = lambda: cfe.run(q, k, v, target, geom, scale)
    # Serial stand-in: the local result copied into the owners' buffers (the post-A2A's bytes).
    padded = torch.zeros((1, world * length, hr, d), dtype=dtype, device=dev)
    fns["a2a_copy"] = lambda: view.copy_(padded.view(world, length, hr, d))
    return fns, (q, k, v, qs, ks, vs, window, geom, view, h0, hr)


def _check(fns, state) -> dict:
    """Every window kernel vs the fp32 reference on the row's inputs, the window NaN-poisoned first."""
    from xstage_dit.ops.attention.reference import attention_reference

    q, k, v, qs, ks, vs, window, geom, view, h0, hr = state
    rows = geom.owner_rows()
    ref = attention_reference(qs[:, :2048], ks, vs)
    errs = {}
    for name in WINDOW_FNS:
        if name not in fns:
            continue
        view.fill_(float("nan"))
        fns[name]()
        torch.cuda.synchronize()
        got = torch.cat([view[o, :rows[o]] for o in range(geom.world_size)], dim=0)[None, :2048]
        errs[name] = float("nan") if torch.isnan(got).any() else (
            (got.float() - ref.float()).norm() / ref.float().norm()).item()
    return errs


REQUIRED_FNS = ("cudnn", "a2a_copy")  # the ratios' base and the serial path's copy: in every row


def window_rows(time_fn, interleaved_times, shapes=WINDOW_SHAPES, worlds=WORLDS, rounds=3,
                cudnn_fe_seqs=(4608, 8192, 32768), checkpoint=None, odd_stride: bool = False,
                columns: tuple[str, ...] | None = None) -> list[dict]:
    """columns: the timed variants to keep (e.g. ``("fa4", "fa4_window", "fa4gqa_window")``; cuDNN and the copy
    are always timed), None for all: a call that must fit a time limit times what it is about."""
    rows = []
    for seq, heads, origin in shapes:
        for world in worlds:
            for scope in (("all",) if world == 1 else ("rank", "all")):
                fns, state = _variants(seq, heads, world, scope, with_cudnn_fe=seq in cudnn_fe_seqs,
                                       odd_stride=odd_stride)
                if columns is not None:
                    fns = {n: f for n, f in fns.items() if n in columns or n in REQUIRED_FNS}
                hr = state[-1]
                row = {"seq_len": seq, "heads": heads, "world": world, "scope": scope, "heads_launched": hr,
                       "head_offset": state[-2], "origin": origin, "rounds": rounds}
                kernel_errors: dict[str, str] = {}
                try:
                    row["rel_err"] = _check(fns, state)
                    # One kernel that fails to time (e.g. cudnn-frontend inside a CUDA-graph capture: 4608 x 40,
                    # P = 8 at 4135c19) costs its column, not the row; cuDNN, the ratios' base, is required.
                    per_round = interleaved_times(fns, time_fn, rounds=rounds, errors=kernel_errors,
                                                  required=REQUIRED_FNS)
                    if kernel_errors:
                        torch.cuda.synchronize()  # a failure that broke the context fails the row here
                        row["kernel_errors"] = kernel_errors
                except Exception as exc:  # noqa: BLE001 - a failing kernel is a result; the row says which
                    row["error"] = repr(exc)[:400]
                    rows.append(row)
                    print(f"S={seq} H={heads} P={world} {scope}: FAILED {row['error']}", flush=True)
                    state[6].close()
                    continue
                flops = 4.0 * seq * seq * hr * 128
                for name, times in per_round.items():
                    row[f"ms_{name}"] = statistics.median(times)
                    if name != "a2a_copy":
                        row[f"x_{name}"] = row["ms_cudnn"] / row[f"ms_{name}"]
                        row[f"tflops_{name}"] = flops / row[f"ms_{name}"] / 1e9
                for kern, local in (("fa4", "fa4"), ("fa4m64", "fa4m64"), ("fa4split", "fa4"), ("fa4gqa", "fa4"),
                                    ("fa4gqaunpacked", "fa4"),
                                    ("triton", "triton_local"), ("cudnn", "cudnnfe_local")):
                    if f"ms_{kern}_window" in row and f"ms_{local}" in row:
                        row[f"residual_{kern}_pct"] = 100.0 * (row[f"ms_{kern}_window"] / row[f"ms_{local}"] - 1)
                if all(f"ms_{n}" in row for n in ("fa4", "fa4_oblocal", "fa4_window")):
                    # the FA4 residual, split: owner-batch launch, then window stores
                    row["residual_fa4_layout_pct"] = 100.0 * (row["ms_fa4_oblocal"] / row["ms_fa4"] - 1)
                    row["residual_fa4_stores_pct"] = 100.0 * (row["ms_fa4_window"] / row["ms_fa4_oblocal"] - 1)
                locals_ = [row[f"ms_{n}"] for n in ("cudnn", "fa4", "fa4m64", "triton_local") if f"ms_{n}" in row]
                row["ms_serial"] = min(locals_) + row["ms_a2a_copy"]
                row["x_serial"] = row["ms_cudnn"] / row["ms_serial"]
                fused = {n: row[f"ms_{n}"] for n in WINDOW_FNS
                         if f"ms_{n}" in row and math.isfinite(row["rel_err"].get(n, float("nan")))
                         and row["rel_err"][n] < 2e-2}
                if fused:
                    best = min(fused, key=fused.get)
                    row["best_window"] = best
                    row["x_fused"] = row["ms_cudnn"] / fused[best]
                rows.append(row)
                state[6].close()
                print(f"S={seq:6d} H={heads} P={world} {scope:4s} Hr={hr:2d}: cudnn {row['ms_cudnn']:.3f} ms | "
                      + " ".join(f"{n} x{row[f'x_{n}']:.3f}" for n in ("fa4", *WINDOW_FNS, "serial")
                                 if f"x_{n}" in row)
                      + f" | best {row.get('best_window')} | err {row['rel_err']}"
                      + (f" | FAILED {kernel_errors}" if kernel_errors else ""), flush=True)
                if checkpoint is not None:
                    checkpoint(rows)
                del fns, state
                torch.cuda.empty_cache()
    return rows


def _shape_key(row: dict) -> str:
    """A row's shape as the summary names it, e.g. ``S4608_H24_P8_rank``."""
    return f"S{row['seq_len']}_H{row['heads']}_P{row['world']}_{row['scope']}"


def _best_residual(row: dict) -> float | None:
    """The residual (%) of the row's best window kernel over plain FA4 on the local layout, if measured."""
    return row.get(f"residual_{row['best_window'].split('_')[0]}_pct")


def window_summary(rows) -> dict:
    ok = [r for r in rows if "x_fused" in r]
    by_shape = {_shape_key(r): round(r["x_fused"], 4) for r in ok}
    long = [r for r in ok if r["seq_len"] >= 16384]
    short = [r for r in ok if r["seq_len"] < 16384]
    res = [(r, _best_residual(r)) for r in ok if _best_residual(r) is not None]
    per_rank = [v for r, v in res if r["scope"] == "rank" and r["world"] > 1]
    # At P = 1 the window is the local layout (one owner): whatever its "residual" reads is the table's noise.
    same_work = [abs(v) for r, v in res if r["world"] == 1]
    summary = {
        "fused_over_cudnn": min(r["x_fused"] for r in ok) if ok else None,
        "fused_over_cudnn_from_16k": min(r["x_fused"] for r in long) if long else None,
        "fused_over_cudnn_below_16k": min(r["x_fused"] for r in short) if short else None,
        "residual_pct_max": max(v for _, v in res) if res else None,
        "residual_pct_max_per_rank": max(per_rank) if per_rank else None,  # the H/P-head launches ranks run
        "residual_noise_floor_pct": max(same_work) if same_work else None,
        "by_shape": by_shape,
        "best_kernel_by_shape": {_shape_key(r): r["best_window"] for r in ok},
        "failed_rows": [_shape_key(r) for r in rows if "error" in r],
        "failed_kernels": {_shape_key(r): r["kernel_errors"] for r in rows if r.get("kernel_errors")},
        "scope": "one GPU; min over all rows, per-rank (H/P heads at the last rank's head offset) and all-heads",
        "targets": {"from_16k": 1.0, "below_16k": 0.95, "residual_pct": 2.0},
    }
    return summary


WINDOW_COLUMNS = ["seq_len", "heads", "world", "scope", "heads_launched", "ms_cudnn", "x_fa4", "x_fa4_window",
                  "x_fa4m64", "x_fa4m64_window", "x_fa4split_window", "x_fa4gqa_window", "x_fa4gqaunpacked_window",
                  "x_cudnnfe_local",
                  "x_cudnn_window", "x_triton_local", "x_triton_window", "x_serial", "x_fused", "best_window",
                  "residual_fa4_pct", "residual_fa4_layout_pct", "residual_fa4_stores_pct", "residual_fa4m64_pct",
                  "residual_fa4split_pct", "residual_fa4gqa_pct", "residual_fa4gqaunpacked_pct",
                  "residual_cudnn_pct", "residual_triton_pct"]
