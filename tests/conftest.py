"""Hardware gating in one place: `gpu` and `multigpu` tests are skipped, visibly and counted, without
the hardware. A GPU test never passes without running its subject."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    num_gpus = _cuda_device_count()
    for item in items:
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"multigpu: needs >= 2 CUDA GPUs, found {num_gpus}"))
        elif "gpu" in item.keywords and num_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="gpu: needs a CUDA GPU, found none"))
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the order is the scheduler's queue
        items[:] = slow_files_first(items)


def slow_files_first(items: list) -> list:
    """`items` with whole files reordered, each file's own order kept: files with more `slow` tests first, then
    the others by their number of tests (pytest-xdist's own order for ``--dist loadfile``), ties in path order.

    Why: scripts/test.sh hands whole files to two workers in this order (``--no-loadscope-reorder``). By test count
    alone, a file of two tests that take minutes (the stack cycles) came last and ran on one worker while the
    other, done, waited; started first, the long files run beside the many short ones, which even out the end."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def key(path: str) -> tuple:
        tests = files[path]
        slow = sum(1 for t in tests
                   if t.get_closest_marker("slow") is not None and t.get_closest_marker("skip") is None)
        return -slow, -len(tests), path

    return [item for path in sorted(files, key=key) for item in files[path]]


def pytest_terminal_summary(terminalreporter):
    # Counted from the skip reports, not from collection: under pytest-xdist the workers collect, and only the
    # reports reach the process that writes this line.
    counts = {"gpu": 0, "multigpu": 0}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        kind = reason.removeprefix("Skipped: ").split(":", 1)[0]
        if kind in counts:
            counts[kind] += 1
    if any(counts.values()):
        terminalreporter.write_line(
            f"hardware-gated tests skipped: gpu={counts['gpu']} multigpu={counts['multigpu']} "
            "(run scripts/gpu_tests.sh on a GPU machine)",
            yellow=True,
        )
