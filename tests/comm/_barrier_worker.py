"""One rank of the abortable-barrier checks (launched by tests/comm/test_barrier_gpu.py with RANK/WORLD_SIZE/
MASTER_ADDR/MASTER_PORT set; gloo for control, torch symmetric memory for data). Prints one JSON line.

argv: mode [iterations]
- order N: N eager barriers, then N more as replays of a captured CUDA graph; before each, every rank
  writes the iteration into its row of each peer's buffer (double-buffered), after it reads the peers'
  rows: the count of wrong values must be 0. A rank lags now and then (a GPU sleep) to stress the order.
- raise: a hooked module (CollectiveSafetyHook) calls the fused attention op twice a forward; at step 3
  rank 1 raises between the two calls (before the second one's barriers). Every rank must end with the
  same RankFailed, rank 0 within 10 s of rank 1's failure (times in the JSON: wall clock, one machine).
- kill: as raise, but rank 1 dies (os._exit) without publishing: rank 0 must raise the barrier timeout
  (run with a short XSTAGE_BARRIER_TIMEOUT_S).
Every rank exits with os._exit after printing: the process group is unusable after a failure.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time

import torch

FAIL_STEP = 3
STEPS = 8


def _emit(result: dict, code: int = 0) -> None:
    print(json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(code)


def order(info, group, iterations: int) -> dict:
    from xstage_dit.comm.buffers import symmetric_buffer

    rank, world, device = info.rank, info.world_size, info.device
    n_elem = 1 << 16
    buf = symmetric_buffer("barrier_test.data", (2, world, n_elem), torch.int32, device, group)
    result = {"group_barrier": buf.group_barrier is not None}
    if buf.group_barrier is None:
        return {**result, "ok": False}
    peers = {p: buf.handle.get_buffer(p, (2, world, n_elem), torch.int32) for p in range(world) if p != rank}
    errors = torch.zeros((), dtype=torch.int64, device=device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(iterations):
        slot = i % 2
        for p, view in peers.items():
            view[slot, rank].fill_(i)
        if i % 613 == 0:
            # The lagging rank's write lands late: a barrier that let its peer through early reads stale rows.
            if (i // 613) % world == rank:
                torch.cuda._sleep(200_000)
        buf.barrier()
        for p in peers:
            errors += (buf.tensor[slot, p] != i).sum()
    torch.cuda.synchronize()
    eager_s = time.perf_counter() - t0
    result.update(eager_errors=int(errors.item()), eager_us_per_iteration=eager_s / iterations * 1e6)

    # The same under a captured graph: values from a device counter, since captured scalars are frozen.
    per_graph = 50
    replays = max(1, iterations // per_graph)
    counter = torch.zeros((), dtype=torch.int32, device=device)
    graph_errors = torch.zeros((), dtype=torch.int64, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for j in range(per_graph):
            slot = j % 2
            counter += 1
            for p, view in peers.items():
                view[slot, rank].copy_(counter.expand(n_elem))
            if j == 17 and rank == 0:
                torch.cuda._sleep(100_000)
            buf.barrier()
            for p in peers:
                graph_errors += (buf.tensor[slot, p] != counter).sum()
    torch.cuda.synchronize()
    buf.barrier()  # both ranks captured before either replays
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    graph_s = time.perf_counter() - t0
    result.update(graph_errors=int(graph_errors.item()), graph_iterations=replays * per_graph,
                  counter=int(counter.item()), graph_us_per_iteration=graph_s / (replays * per_graph) * 1e6)
    result["ok"] = (result["eager_errors"] == 0 and result["graph_errors"] == 0
                    and result["counter"] == replays * per_graph)
    return result


class TwoFusedCalls(torch.nn.Module):
    """The shape of a block with two fused ops; rank 1 fails between them at FAIL_STEP."""

    def __init__(self, group, rank: int, mode: str) -> None:
        super().__init__()
        self.group, self.rank, self.mode = group, rank, mode
        self.step = 0
        self.t_fail: float | None = None

    def forward(self, hidden_states):
        from xstage_dit.ops.attention.table import fused_attention

        out = fused_attention(hidden_states, hidden_states, hidden_states, group=self.group)
        if self.rank == 1 and self.step == FAIL_STEP:
            self.t_fail = time.time()
            if self.mode == "kill":
                _emit({"rank": 1, "killed": True, "t_fail": self.t_fail})
            raise ValueError("injected failure before the second fused call's barrier")
        out = fused_attention(out, hidden_states, hidden_states, group=self.group)
        self.step += 1
        return out


def failing_forward(info, group, mode: str) -> dict:
    from diffusers.hooks import HookRegistry

    from xstage_dit.comm.agreement import RankFailed
    from xstage_dit.features.collective_safety import CollectiveSafetyHook

    model = TwoFusedCalls(group, info.rank, mode)
    HookRegistry.check_if_exists_or_initialize(model).register_hook(
        CollectiveSafetyHook(group, TwoFusedCalls, True), "xstage_collective_safety")
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 128, 4, 64, generator=gen).to(device=info.device, dtype=torch.bfloat16)
    result = {"rank": info.rank, "steps_done": 0}
    try:
        for step in range(STEPS):
            y = model(x)
            result["steps_done"] = step + 1
        torch.cuda.synchronize()
        result["finite"] = bool(torch.isfinite(y).all())
        result["raised"] = None
    except RankFailed as exc:
        result.update(raised=type(exc).__name__, message=str(exc), t_error=time.time(),
                      is_value_error=isinstance(exc, ValueError), is_timeout=isinstance(exc, TimeoutError))
    result["t_fail"] = model.t_fail
    return result


def main() -> int:
    mode = sys.argv[1]
    iterations = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    # Never outlive the test: dump every thread's stack and exit if something hangs after all.
    faulthandler.dump_traceback_later(float(os.environ.get("XSTAGE_TEST_WORKER_LIMIT_S", "240")), exit=True)

    import torch.distributed as dist

    from xstage_dit.comm.distributed import init_distributed

    info = init_distributed(backend="gloo", timeout_s=120)
    group = dist.group.WORLD
    if mode == "order":
        result = {"rank": info.rank, **order(info, group, iterations)}
        dist.barrier()
        _emit(result, 0 if result["ok"] else 1)
    _emit(failing_forward(info, group, mode))
    return 0


if __name__ == "__main__":
    sys.exit(main())
