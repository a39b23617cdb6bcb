"""Hardware gating in one place: `gpu` and `multigpu` tests are skipped, visibly and counted, without
the hardware. A GPU test never passes without running its subject. Under pytest-xdist: the order in which whole
files go to the workers, longest first (`longest_files_first`, from the seconds in tests/file_seconds.json)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# Triton's interpreter flag as the suite found it: a test module that set it while being imported would turn the
# interpreter on for every Triton kernel its worker imports afterwards (CI, 2026-12-07: nine unrelated failures).
# Interpreter runs belong in a child process (`tests.helpers.interp.run_interp_script`).
_INTERPRET_AT_START = os.environ.get("TRITON_INTERPRET")


def pytest_collection_finish(session):
    if os.environ.get("TRITON_INTERPRET") != _INTERPRET_AT_START:
        raise pytest.UsageError(f"a test module changed TRITON_INTERPRET while being collected (now "
                                f"{os.environ.get('TRITON_INTERPRET')!r}, was {_INTERPRET_AT_START!r}): set it in "
                                "the child process that runs the interpreter cases, not at import")


def pytest_collection_modifyitems(config, items):
    num_gpus = _cuda_device_count()
    for item in items:
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"multigpu: needs >= 2 CUDA GPUs, found {num_gpus}"))
        elif "gpu" in item.keywords and num_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="gpu: needs a CUDA GPU, found none"))
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the order is the scheduler's queue
        items[:] = longest_files_first(items)


#: Seconds each file took on the 2-core CI machine under scripts/test.sh (files of 3 s or more, setup and teardown
#: included): the order of `longest_files_first`. Refreshed with ``./scripts/test.sh --record-file-seconds
#: tests/file_seconds.json``; a file missing from it (a new one) is estimated from its tests.
FILE_SECONDS = Path(__file__).with_name("file_seconds.json")
SLOW_TEST_S, TEST_S = 30.0, 0.1  # estimates for a file not in FILE_SECONDS: a `slow` test, any other test


def longest_files_first(items: list, seconds: dict[str, float] | None = None) -> list:
    """`items` with whole files reordered, each file's own order kept: the longest first, by the seconds recorded in
    `FILE_SECONDS` (`seconds` overrides it), else an estimate from the file's tests (`SLOW_TEST_S` for a `slow` one
    that is not skipped, `TEST_S` for any other); ties in path order.

    Why: scripts/test.sh hands whole files to two workers in this order (``--no-loadscope-reorder``), each taking the
    next file as it runs out of work. Longest first (list scheduling), the long files run beside many short ones,
    which even out the end: by test count the files of one or two long tests (the stack cycles, the multi-rank
    servers) came last and ran on one worker while the other, done, waited; by `slow` count the Ray Serve replicas
    (the longest file by far) started after the saved folders of every family, a file of many short `slow` tests."""
    if seconds is None:
        seconds = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.is_file() else {}
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def estimate(path: str) -> float:
        if path in seconds:
            return seconds[path]
        tests = files[path]
        slow = sum(1 for t in tests
                   if t.get_closest_marker("slow") is not None and t.get_closest_marker("skip") is None)
        return slow * SLOW_TEST_S + (len(tests) - slow) * TEST_S

    return [item for path in sorted(files, key=lambda p: (-estimate(p), p)) for item in files[path]]


class FileSecondsRecorder:
    """Sums each file's test phases (setup, call, teardown) and writes the files of 3 s or more to `path` as JSON at
    the end of the session: the `FILE_SECONDS` table. Registered in the process that gets every report (the
    controller under pytest-xdist) when ``--record-file-seconds PATH`` names the file to write."""

    def __init__(self, path: Path):
        self.path, self.seconds = path, {}

    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::", 1)[0]
        self.seconds[path] = self.seconds.get(path, 0.0) + report.duration

    def pytest_sessionfinish(self, session):
        table = {p: round(s) for p, s in sorted(self.seconds.items(), key=lambda kv: (-kv[1], kv[0])) if s >= 3}
        self.path.write_text(json.dumps(table, indent=1) + "\n")


def pytest_addoption(parser):
    parser.addoption("--record-file-seconds", metavar="PATH", default=None,
                     help="write each test file's seconds to PATH (the table of tests/file_seconds.json)")


def pytest_configure(config):
    out = config.getoption("--record-file-seconds")
    if out and not hasattr(config, "workerinput"):
        config.pluginmanager.register(FileSecondsRecorder(Path(out)), "xstage-file-seconds")


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
