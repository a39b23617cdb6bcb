"""benchmarks/bench_e2e.py sync-points: warnings captured with their stacks, grouped by the line that asked (the
GPU run itself needs CUDA: on a CPU it refuses with a clear error)."""

from __future__ import annotations

import warnings

import pytest
import torch

from benchmarks._e2e_sync_points import SYNC_MESSAGE, asker, captured_warnings, group_sync_points


def _copy_to_gpu_like():
    warnings.warn(f"called a {SYNC_MESSAGE}")  # stands for torch's warning, raised where the op was called


def _caller_a():
    for _ in range(3):
        _copy_to_gpu_like()


def _caller_b():
    _copy_to_gpu_like()
    warnings.warn("an unrelated warning")


def test_each_sync_warning_is_kept_with_its_stack_and_grouped_by_the_asking_line():
    with pytest.warns(UserWarning, match="unrelated"):  # other warnings still reach the previous handler
        with captured_warnings(SYNC_MESSAGE) as stacks:
            _caller_a()
            _caller_b()
    assert len(stacks) == 4  # every occurrence, not once per location
    assert all(asker(s).name == "_copy_to_gpu_like" for s in stacks)
    rows = group_sync_points(stacks)
    assert len(rows) == 1 and rows[0]["count"] == 4  # one asking line: the warn call
    assert "_copy_to_gpu_like" in rows[0]["where"] and "warnings.warn" in rows[0]["line"]


def test_a_torch_frame_is_skipped_for_the_caller_outside_torch():
    import traceback

    torch_file = torch.__file__
    stack = [traceback.FrameSummary("/x/diffusers/pipelines/p.py", 10, "__call__", line="latents.to(device)"),
             traceback.FrameSummary(torch_file, 5, "to", line="")]
    row, = group_sync_points([stack, stack])
    assert row == {"where": "diffusers/pipelines/p.py:10 __call__", "count": 2, "line": "latents.to(device)",
                   "context": []}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_without_a_gpu_sync_points_says_why():
    from benchmarks.bench_e2e import main

    with pytest.raises(SystemExit) as exit_info:
        main(["sync-points", "--model", "tiny-nucleusmoe"])
    assert exit_info.value.code == 2
