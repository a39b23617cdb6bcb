"""Serial Ulysses attention over real gloo process groups (2 and 4 CPU processes), against the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
from _ulysses_launch import launch

WORKER = Path(__file__).with_name("_ulysses_worker.py")


@pytest.mark.parametrize(
    "world_size, seq_len, heads, dtype",
    [
        (2, 37, 4, "float32"),   # sequence not divisible by P: chunks 19, 18
        (4, 6, 5, "bfloat16"),   # heads not divisible (2, 1, 1, 1); chunks 2, 2, 2, 0: the last rank is empty
    ],
)
def test_serial_matches_reference_over_gloo(world_size, seq_len, heads, dtype):
    results = launch(WORKER, world_size, ["serial", "2", str(seq_len), str(heads), "16", dtype, "cpu"], timeout_s=180)
    assert [r["rank"] for r in results] == list(range(world_size))
    assert sum(r["seq_local"] for r in results) == seq_len
    for r in results:
        for attempt in (0, 1):
            assert r[f"rel_err_{attempt}"] < (1e-4 if dtype == "float32" else 2e-2), r
        assert not r["nan"]
