"""The pre-attention All-to-All rows of ``bench_attention_a2a.py --window --pre-a2a``, on one GPU.

For every (S, H, P) (bf16, D=128, B=1), the pre-A2A of all P virtual ranks (each rank's tokens of every head
group into that head owner's (3, B, P*L, Hr_max, D) input buffer), timed in interleaved rounds:

- ``push``: the Triton push kernel of the fused path (``table.push_to_owners``), one launch per rank (today's);
- ``copy``: torch ``copy_`` of each (rank, owner, q/k/v) head slice into the owner's buffer view (strided,
  so torch runs its copy kernel on the SMs);
- ``memcpy2d``: the same slices as pitched copies (``window.pre_a2a_copies`` through ``comm.copy_engine``,
  ``cuMemcpy2DAsync``: the copy engine, no SM);
- ``library``: what the library All-to-All path does around NCCL, with virtual ranks (NCCL refuses ranks
  that share a GPU): each rank packs its send buffer (``serial.pack_for_owners``), every (source, owner)
  chunk is one contiguous copy (the bytes NCCL would move), each owner unpacks (``unpack_from_sources``).

On one GPU every byte stays in HBM: the rows compare the engines' local cost, not NVLink. Every variant's
owner buffers are checked equal to the push kernel's (bit for bit: it is a copy) before timing.
"""

from __future__ import annotations

import statistics

import torch

from xstage_dit.ops.attention.partition import head_split, shard_bounds

PRE_SHAPES = [(4608, 24, "FLUX 1024^2"), (4608, 40, "4608 tokens, 40 heads"), (8192, 24, "8K"),
              (16384, 24, "16K"), (16384, 40, "16K, Wan heads"), (32768, 24, "32K"), (32768, 40, "32K, Wan heads"),
              (65536, 24, "64K"), (65536, 40, "64K, Wan heads")]
PRE_WORLDS = (2, 4, 8)
PRE_COLUMNS = ["seq_len", "heads", "world", "mb_moved", "ms_push", "ms_copy", "ms_memcpy2d", "ms_library",
               "gbps_push", "gbps_memcpy2d", "fastest", "fastest_over_push"]
VARIANTS = ("push", "copy", "memcpy2d", "library")


def _variants(seq: int, heads: int, world: int):
    """{name: fn} writing the owners' buffers (each variant its own set; the library path its unpacked
    tensors), those buffers, and the bytes moved."""
    from xstage_dit.comm.copy_engine import memcpy_2d_async
    from xstage_dit.ops.attention.serial import pack_for_owners, unpack_from_sources
    from xstage_dit.ops.attention.table import push_to_owners
    from xstage_dit.ops.attention.window import pre_a2a_copies

    batch, d, dtype, dev = 1, 128, torch.bfloat16, torch.device("cuda")
    length = -(-seq // world)
    ranges = head_split(heads, world)
    hmax = ranges[0][1]
    full = [torch.randn((batch, seq, heads, d), dtype=dtype, device=dev) for _ in range(3)]
    shards = [[t[:, s:s + n].contiguous() for t in full] for s, n in shard_bounds(seq, world)]

    def owner_buffers():
        return [torch.zeros((3, batch, world * length, hmax, d), dtype=dtype, device=dev) for _ in range(world)]

    bufs = {name: owner_buffers() for name in VARIANTS if name != "library"}
    # The library path ends in the unpacked (3, B, P*L, Hr, D) tensor itself (serial attention reads it).
    bufs["library"] = [None] * world
    table = torch.tensor([b.data_ptr() for b in bufs["push"]], dtype=torch.int64, device=dev)

    def push():
        for r, (q, k, v) in enumerate(shards):
            if q.shape[1]:
                push_to_owners(q, k, v, table, bufs["push"][0], rank=r, world_size=world, seq_len=seq)

    views = []
    for r, (start, n) in enumerate(shard_bounds(seq, world)):
        for o, (h0, hr) in enumerate(ranges):
            for t in range(3):
                if n:
                    dst = bufs["copy"][o][t, :, r * length:r * length + n, :hr]
                    views.append((dst, shards[r][t][:, :, h0:h0 + hr]))

    def copy():
        for dst, src in views:
            dst.copy_(src)

    plan = pre_a2a_copies(batch=batch, seq_len=seq, heads=heads, head_dim=d, world_size=world, elem_bytes=2)
    args = [(bufs["memcpy2d"][c.owner].data_ptr() + c.dst_offset, c.dst_pitch,
             shards[c.src_rank][c.tensor].data_ptr() + c.src_offset, c.src_pitch, c.width, c.height) for c in plan]

    def memcpy2d():
        stream = torch.cuda.current_stream().cuda_stream
        for a in args:
            memcpy_2d_async(*a, stream)

    def library():
        sends = [pack_for_owners(q, k, v, world_size=world, seq_len=seq) for q, k, v in shards]
        for o, (_, hr) in enumerate(ranges):
            recv = torch.cat([send[sum(splits[:o]):sum(splits[:o + 1])] for send, splits in sends])
            bufs["library"][o] = unpack_from_sources(recv, world_size=world, batch=batch, seq_len=seq, my_heads=hr,
                                                     head_dim=d)

    moved = 3 * batch * seq * heads * d * 2
    return {"push": push, "copy": copy, "memcpy2d": memcpy2d, "library": library}, bufs, moved


def _check(fns, bufs) -> dict:
    """Each variant's owner buffers equal the push kernel's, bit for bit (a copy), after one call on zeros."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    return {name: all(torch.equal(a, b[:, :, :, :a.shape[3]]) for a, b in zip(bufs[name], bufs["push"]))
            for name in VARIANTS if name != "push"}


def pre_a2a_rows(time_fn, interleaved_times, shapes=PRE_SHAPES, worlds=PRE_WORLDS, rounds=3, checkpoint=None
                 ) -> list[dict]:
    rows = []
    for seq, heads, origin in shapes:
        for world in worlds:
            row = {"seq_len": seq, "heads": heads, "world": world, "origin": origin, "rounds": rounds}
            try:
                fns, bufs, moved = _variants(seq, heads, world)
                row["equal_to_push"] = _check(fns, bufs)
                good = {n: f for n, f in fns.items() if n == "push" or row["equal_to_push"][n]}
                per_round = interleaved_times(good, time_fn, rounds=rounds)
            except Exception as exc:  # noqa: BLE001 - a failing variant is a result; the row says which
                row["error"] = repr(exc)[:400]
                rows.append(row)
                print(f"pre-A2A S={seq} H={heads} P={world}: FAILED {row['error']}", flush=True)
                continue
            row["mb_moved"] = moved / 1e6
            for name, times in per_round.items():
                row[f"ms_{name}"] = statistics.median(times)
                row[f"gbps_{name}"] = moved / row[f"ms_{name}"] / 1e6
            timed = {n: row[f"ms_{n}"] for n in per_round}
            row["fastest"] = min(timed, key=timed.get)
            row["fastest_over_push"] = row["ms_push"] / timed[row["fastest"]]
            rows.append(row)
            times = " ".join(f"{n} {row[f'ms_{n}']:.3f}" for n in per_round)
            print(f"pre-A2A S={seq:6d} H={heads} P={world}: {times} ms | fastest {row['fastest']} | "
                  f"equal {row['equal_to_push']}", flush=True)
            if checkpoint is not None:
                checkpoint(rows)
            del fns, bufs
            torch.cuda.empty_cache()
    return rows


def pre_a2a_summary(rows) -> dict:
    ok = [r for r in rows if "fastest" in r]
    key = lambda r: f"S{r['seq_len']}_H{r['heads']}_P{r['world']}"  # noqa: E731
    counts = {}
    for r in ok:
        counts[r["fastest"]] = counts.get(r["fastest"], 0) + 1
    return {
        "fastest_by_shape": {key(r): r["fastest"] for r in ok},
        "fastest_over_push_by_shape": {key(r): round(r["fastest_over_push"], 4) for r in ok},
        "fastest_counts": counts,
        "not_equal": [f"{key(r)}:{n}" for r in ok for n, same in r["equal_to_push"].items() if not same],
        "failed_rows": [key(r) for r in rows if "error" in r],
        "scope": "one GPU, all P virtual ranks' pre-A2A; bytes stay in HBM (no NVLink); library = pack + "
                 "contiguous chunk copies + unpack, the local work around NCCL",
    }
