"""The abortable device barrier on a GPU: two processes sharing it (TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1,
gloo for control), as a peer window test does. Marked `gpu`: skipped, and counted, without one.

Run: PYTHONPATH=$PWD python -m pytest -q -s tests/comm/test_barrier_gpu.py
(-s shows the measured barrier cost and time-to-error lines.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_barrier_worker.py")
SHARED = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}


def _launch(args, extra_env=None, timeout_s=300.0):
    from tests.ops._ulysses_launch import launch

    return launch(WORKER, 2, args, timeout_s=timeout_s, extra_env={**SHARED, **(extra_env or {})})


@pytest.mark.gpu
def test_ten_thousand_barriers_order_the_peers_writes_eager_and_in_a_graph():
    results = _launch(["order", "10000"])
    for r in results:
        print(f"rank {r['rank']}: {r.get('eager_us_per_iteration', float('nan')):.1f} us/iteration eager, "
              f"{r.get('graph_us_per_iteration', float('nan')):.1f} us/iteration as graph replays")
        assert r["group_barrier"], f"the abortable barrier did not run (torch's fallback was chosen): {r}"
        assert r["eager_errors"] == 0, r
        assert r["graph_errors"] == 0 and r["graph_iterations"] >= 10000 and r["counter"] == r["graph_iterations"], r


@pytest.mark.gpu
def test_a_rank_failing_mid_forward_fails_its_peer_promptly_with_the_same_error():
    results = _launch(["raise"], timeout_s=120.0)
    by_rank = {r["rank"]: r for r in results}
    assert set(by_rank) == {0, 1}, results
    failed, peer = by_rank[1], by_rank[0]
    assert failed["raised"] and failed["raised"].startswith("RankFailed") and failed["is_value_error"], failed
    assert peer["raised"] == failed["raised"] and peer["message"] == failed["message"], (peer, failed)
    assert "injected failure" in peer["message"] and "rank 1" in peer["message"], peer
    delay = peer["t_error"] - failed["t_fail"]
    print(f"time from rank 1's failure to rank 0's RankFailed: {delay:.3f} s (rank 0 had finished "
          f"{peer['steps_done']} forwards)")
    assert 0 <= delay < 10.0, delay


@pytest.mark.gpu
def test_a_killed_rank_makes_its_peer_raise_the_barrier_timeout():
    timeout_s = 3
    results = _launch(["kill"], extra_env={"XSTAGE_BARRIER_TIMEOUT_S": str(timeout_s)}, timeout_s=120.0)
    by_rank = {r["rank"]: r for r in results}
    killed, peer = by_rank[1], by_rank[0]
    assert killed.get("killed"), killed
    assert peer["raised"] and peer["raised"].startswith("RankFailed") and peer["is_timeout"], peer
    assert f"XSTAGE_BARRIER_TIMEOUT_S={timeout_s} s" in peer["message"] and "ranks [0, 1]" in peer["message"], peer
    delay = peer["t_error"] - killed["t_fail"]
    print(f"time from rank 1's death to rank 0's timeout error: {delay:.3f} s (timeout {timeout_s} s)")
    assert timeout_s - 0.5 <= delay < timeout_s + 10.0, delay
