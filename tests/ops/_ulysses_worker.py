"""One rank of a multi-process Ulysses attention check (launched by the tests with RANK/WORLD_SIZE/
MASTER_ADDR/MASTER_PORT set). Prints one JSON line of results; exits non-zero on a mismatch.

argv: schedule batch seq_len heads head_dim dtype device
Every rank draws the same global q, k, v from one seed and keeps its chunk (torch.chunk convention).
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main() -> int:
    schedule, batch, seq_len, heads, head_dim, dtype_name, device_type = sys.argv[1:8]
    batch, seq_len, heads, head_dim = int(batch), int(seq_len), int(heads), int(head_dim)
    dtype = getattr(torch, dtype_name)

    from xstage_dit.comm.distributed import init_distributed
    from xstage_dit.ops.attention import (fused_attention_virtual_ranks, shard_bounds, ulysses_attention,
                                                  ulysses_attention_reference)

    # gloo by default (ranks sharing one GPU, or the CPU); XSTAGE_TEST_BACKEND=nccl for one GPU per rank.
    backend = os.environ.get("XSTAGE_TEST_BACKEND", "gloo")
    info = init_distributed(backend=backend, timeout_s=120)
    device = info.device if device_type == "cuda" else torch.device("cpu")
    import torch.distributed as dist

    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(1234)
    full = [torch.randn(batch, seq_len, heads, head_dim, generator=gen).to(device=device, dtype=dtype) for _ in range(3)]
    start, length = shard_bounds(seq_len, info.world_size)[info.rank]
    q, k, v = (t[:, start:start + length] for t in full)
    result = {"rank": info.rank, "world_size": info.world_size, "seq_local": length, "backend": backend,
              "device_index": device.index}
    ok = True
    for attempt in range(2):  # the second call reuses the cached buffers (no rendezvous on the hot path)
        out = ulysses_attention(q, k, v, group=group, schedule=schedule, seq_len=seq_len)
        if out.shape != q.shape:
            result["shape"] = list(out.shape)
            ok = False
        ref = ulysses_attention_reference(q, k, v, group=group, seq_len=seq_len)
        err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item() if length else 0.0
        result[f"rel_err_{attempt}"] = err
        result["nan"] = bool(torch.isnan(out).any())
        ok = ok and err < (2e-2 if dtype != torch.float32 else 1e-4) and not result["nan"]
    if schedule == "fused":
        # Same kernel, same tiles, same KV order: the sharded result equals the one-process one bit for bit.
        single = fused_attention_virtual_ranks(*full, world_size=1)[0][:, start:start + length]
        result["equal_to_single_process"] = bool(torch.equal(single, out))
        ok = ok and result["equal_to_single_process"]
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    # The result is printed and the group destroyed; leave without running interpreter teardown, where
    # gloo's background threads sometimes abort the process ("terminate called without an active
    # exception", exit -6) after the work succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
