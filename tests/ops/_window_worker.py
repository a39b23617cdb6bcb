"""One rank of the peer-window check (launched with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set; gloo for
control, torch symmetric memory for data). Prints one JSON line; exits non-zero on a mismatch.

argv: kernel batch seq_len heads head_dim dtype
Every rank draws the same global q, k, v from one seed and keeps its chunk. The window's output buffers
are poisoned with NaN before each call; the result must equal the one-process run of the same kernel
through a local window (P virtual ranks) bit for bit, and match the fp32 reference.
"""

from __future__ import annotations

import json
import sys

import torch


def main() -> int:
    kernel_name, batch, seq_len, heads, head_dim, dtype_name = sys.argv[1:7]
    batch, seq_len, heads, head_dim = int(batch), int(seq_len), int(heads), int(head_dim)
    dtype = getattr(torch, dtype_name)

    import torch.distributed as dist

    from xstage_dit.comm.distributed import init_distributed
    from xstage_dit.comm.buffers import peer_window
    from xstage_dit.ops.attention.kernels import make_kernel
    from xstage_dit.ops.attention.partition import shard_bounds
    from xstage_dit.ops.attention.reference import attention_reference
    from xstage_dit.ops.attention.window_path import fused_window_attention, window_attention_virtual_ranks

    info = init_distributed(backend="gloo", timeout_s=120)
    group = dist.group.WORLD
    p = info.world_size
    gen = torch.Generator().manual_seed(4321)
    full = [torch.randn(batch, seq_len, heads, head_dim, generator=gen).to(device=info.device, dtype=dtype)
            for _ in range(3)]
    start, length = shard_bounds(seq_len, p)[info.rank]
    q, k, v = (t[:, start:start + length] for t in full)
    kernel = make_kernel(kernel_name)
    chunk = -(-seq_len // p)
    window, outs = peer_window("ulysses_window.out", (chunk, heads, head_dim), dtype, info.device, group,
                               segments=batch)
    result = {"rank": info.rank, "world_size": p, "seq_local": length, "slot_bytes": window.slot_bytes,
              "devices": torch.cuda.device_count()}
    ok = True
    single = window_attention_virtual_ranks(*full, world_size=p, kernel=kernel)
    mine_single = single.outs[info.rank]
    single.window.close()
    ref = attention_reference(*full)[:, start:start + length]
    for attempt in range(2):  # the second call reuses the cached window (nothing maps on the hot path)
        for o in outs:
            o.tensor.fill_(float("nan"))
        torch.cuda.synchronize()
        outs[0].barrier()
        out = fused_window_attention(q, k, v, group=group, kernel=kernel, seq_len=seq_len)
        torch.cuda.synchronize()
        err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item() if length else 0.0
        result[f"rel_err_{attempt}"] = err
        result[f"nan_{attempt}"] = bool(torch.isnan(out).any())
        result[f"equal_to_single_process_{attempt}"] = bool(torch.equal(out, mine_single))
        ok = ok and err < 2e-2 and not result[f"nan_{attempt}"] and result[f"equal_to_single_process_{attempt}"]
        # Padding rows of this owner's slots (S not divisible by P) are never written: still NaN.
        if length < chunk:
            result[f"padding_untouched_{attempt}"] = all(bool(torch.isnan(o.tensor[length:]).all()) for o in outs)
            ok = ok and result[f"padding_untouched_{attempt}"]
    dist.barrier()
    print(json.dumps(result), flush=True)
    window.close()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
