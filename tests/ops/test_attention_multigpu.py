"""Ulysses attention between separate GPUs, one process per GPU over NCCL (skipped, and counted, on fewer
than two GPUs): the serial path (cuDNN/SDPA + NCCL All-to-All) and the fused path (remote stores into the
peers' symmetric buffers over NVLink) match the fp32 reference; the fused result equals the one-process
kernel bit for bit. FLUX 1024² (4608 tokens, 24 heads) and an awkward shape (uneven shards and heads)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.multigpu

WORKER = Path(__file__).with_name("_ulysses_worker.py")


def _world() -> int:
    import torch

    return min(4, torch.cuda.device_count())


@pytest.mark.parametrize("schedule", ["serial", "fused"])
@pytest.mark.parametrize("seq_len, heads", [(4608, 24), (999, 5)])
def test_attention_between_separate_gpus_matches_reference(schedule, seq_len, heads):
    from _ulysses_launch import launch

    world = _world()
    results = launch(WORKER, world, [schedule, "2", str(seq_len), str(heads), "128", "bfloat16", "cuda"],
                     timeout_s=300, extra_env={"XSTAGE_TEST_BACKEND": "nccl"})
    assert len(results) == world
    for r in results:
        assert r["backend"] == "nccl" and r["device_index"] == r["rank"], r
        assert r["rel_err_0"] < 2e-2 and r["rel_err_1"] < 2e-2 and not r["nan"], r
        if schedule == "fused":
            assert r["equal_to_single_process"], r
