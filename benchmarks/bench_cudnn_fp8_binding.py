"""Host time of one cuDNN FP8 attention call (`ops.attention.cudnn_fp8`) by how its operands are bound.

The compiled FLUX step with cuDNN FP8 attention spends ~234 us of host time a call in this op under torch's profiler
(57 calls, 13.4 ms a step; fp8/NOTES.md, twenty-fifth session), and a host-bound e2e row took 131.9 ms a step
where the GPU's work is ~88. cudnn-frontend 1.32 executes a graph from several forms of variant pack, which its
Python side reads differently (a bare address is described in Python per slot, a tensor read natively where its
producer publishes DLPack's exchange API; an ordered pack's metadata is cached by value). Bindings, each on the same
graph and the same plan, one call's operands (FLUX.1-dev 1024²: q, k, v (1, 4608, 24, 128) by default):

- ``tensor``: keyed by the graph's tensors, valued by torch tensors (`cudnn_fp8.tensor_pack`: the first call's)
- ``address``: uid -> device address (`cudnn_fp8.variant_pack`: every later call's today)
- ``uid_tensor``: uid -> torch tensor
- ``ordered_tensor`` / ``ordered_address``: ``execute(buffers, ..., tensor_uids=uids)``, tensors or addresses

Each row: the median / p20 / p80 host microseconds of ``graph.execute`` over ``--calls`` calls (perf_counter
around the call alone; the GPU's queue drains between rounds), and whether its O equals the ``tensor`` binding's
bit for bit. A binding the frontend refuses is a row with its error. GPU only (cuDNN >= 9.1, Hopper or newer).

    python benchmarks/bench_cudnn_fp8_binding.py --out-dir benchmarks/results/fp8 --tag h100

Writes <out-dir>/cudnn-fp8-binding-<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, when run as a script

from benchmarks._common import checked_list, environment, write_results  # noqa: E402

BINDINGS = ("tensor", "address", "uid_tensor", "ordered_tensor", "ordered_address")
COLUMNS = ["binding", "status", "host_us_median", "host_us_p20", "host_us_p80", "calls", "equal_output", "error"]


def packs(entry, attn, x, out) -> dict:
    """binding -> (buffers: dict or list, tensor_uids or None) for one call of the graph ``entry``."""
    from xstage_dit.ops.attention import cudnn_fp8 as cf

    graph, t, workspace, handle, sizes, amax, uids, tuned = entry
    by_tensor = cf.tensor_pack(t, x, out, attn._p_scales(x.q.device), amax)
    by_uid = {cf.tensor_uid(key): value for key, value in by_tensor.items()}
    order = sorted(by_uid)
    return {"tensor": (by_tensor, None), "address": (cf.variant_pack(uids, x, out), None),
            "uid_tensor": (by_uid, None), "ordered_tensor": ([by_uid[u] for u in order], order),
            "ordered_address": ([by_uid[u].data_ptr() for u in order], order)}


def measure(args) -> list[dict]:
    from xstage_dit.ops.attention.cudnn_fp8 import CudnnFp8Attention, unavailable
    from xstage_dit.ops.attention.fp8_quant import quantize_qkv

    device = torch.device("cuda")
    b, s, h, d = args.shape
    reason = unavailable(device, d)
    if reason:
        raise SystemExit(f"cuDNN FP8 attention cannot run here: {reason}")
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn((b, s, h, d), device=device, generator=gen, dtype=torch.bfloat16) for _ in range(3))
    x = quantize_qkv(q, k, v)
    attn = CudnnFp8Attention()
    scale = d ** -0.5
    out = torch.empty_like(x.q)
    for _ in range(2):  # the first call builds, tunes and learns the uids; the second runs by uid
        attn.run(x, scale, out)
    entry = attn._graph(tuple(x.q.shape), tuple(x.k.shape), float(scale), device, False)
    graph, workspace, handle = entry[0], entry[2], entry[3]
    if not entry[6]:
        raise SystemExit("the graph's uids were not known after two calls: the address bindings cannot be built")
    torch.cuda.synchronize()
    reference = None
    rows = []
    for name in args.bindings:
        result = torch.empty_like(x.q)
        buffers, tensor_uids = packs(entry, attn, x, result)[name]
        kwargs = {} if tensor_uids is None else {"tensor_uids": tensor_uids}
        row = {"binding": name, "calls": args.calls}
        try:
            graph.execute(buffers, workspace, handle=handle, **kwargs)
            torch.cuda.synchronize()
            host = []
            for _ in range(args.rounds):
                for _ in range(args.calls // args.rounds):
                    t0 = time.perf_counter()
                    graph.execute(buffers, workspace, handle=handle, **kwargs)
                    host.append(1e6 * (time.perf_counter() - t0))
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a binding this frontend refuses is a row saying so
            rows.append({**row, "status": "failed", "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(f"[binding] {name}: failed: {rows[-1]['error']}", flush=True)
            continue
        quintiles = statistics.quantiles(host, n=5)
        if reference is None:
            reference = result.clone()
        row.update(status="ok", host_us_median=round(statistics.median(host), 1), host_us_p20=round(quintiles[0], 1),
                   host_us_p80=round(quintiles[3], 1),
                   equal_output=bool(torch.equal(result.view(torch.uint8), reference.view(torch.uint8))))
        rows.append(row)
        print(f"[binding] {name}: {row['host_us_median']} us a call (p20 {row['host_us_p20']}, p80 "
              f"{row['host_us_p80']}), O equal to the first binding's: {row['equal_output']}", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bindings", default=",".join(BINDINGS), help=f"comma-separated subset of {','.join(BINDINGS)}")
    p.add_argument("--shape", default="1,4608,24,128", help="B,S,H,D of q, k and v (default: FLUX.1-dev 1024²)")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=4, help="the calls in this many rounds, the GPU drained between")
    p.add_argument("--out-dir", default="benchmarks/results/fp8")
    p.add_argument("--tag", default="gpu")
    args = p.parse_args(argv)

    def binding(name: str) -> str:
        if name not in BINDINGS:
            raise ValueError(f"expected bindings from {','.join(BINDINGS)}, got {name!r}")
        return name

    args.bindings = checked_list(p, args.bindings, binding)
    try:
        args.shape = [int(n) for n in args.shape.split(",")]
        if len(args.shape) != 4 or min(args.shape) < 1:
            raise ValueError
    except ValueError:
        p.error(f"expected --shape B,S,H,D of four positive integers, got {args.shape!r}")
    if args.calls < args.rounds or args.rounds < 1:
        p.error(f"expected --calls >= --rounds >= 1, got {args.calls} and {args.rounds}")
    if not torch.cuda.is_available():
        p.error("expected a CUDA GPU (cuDNN's FP8 attention), found none")
    rows = measure(args)
    ok = [r for r in rows if r["status"] == "ok"]
    fastest = min(ok, key=lambda r: r["host_us_median"]) if ok else None
    summary = {"shape": args.shape, "fastest_binding": fastest and fastest["binding"],
               "fastest_host_us": fastest and fastest["host_us_median"]}
    json_path, md_path = write_results(Path(args.out_dir) / f"cudnn-fp8-binding-{args.tag}", "cudnn-fp8-binding", rows,
                                       summary, COLUMNS, env=environment())
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
