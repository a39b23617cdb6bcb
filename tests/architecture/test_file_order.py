"""The order in which pytest-xdist hands whole files to the workers (tests/conftest.py `longest_files_first`): the
longest first by the recorded seconds, new files estimated from their tests, and no stale entry in the table."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import FILE_SECONDS, FileSecondsRecorder, longest_files_first

ROOT = Path(__file__).resolve().parents[2]


class _Item:
    def __init__(self, nodeid: str, *markers: str):
        self.nodeid, self.markers = nodeid, set(markers)

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None


def test_recorded_seconds_go_first_and_a_new_file_is_estimated_from_its_tests():
    items = [_Item("tests/a.py::t1"), _Item("tests/a.py::t2"),
             _Item("tests/new.py::t1", "slow"), _Item("tests/new.py::t2", "slow", "skip"),
             _Item("tests/many.py::t1"), _Item("tests/many.py::t2"), _Item("tests/many.py::t3"),
             _Item("tests/long.py::t1"), _Item("tests/few.py::t1")]
    ordered = longest_files_first(items, seconds={"tests/long.py": 100.0, "tests/a.py": 5.0})
    # long 100 s; new: one slow test that runs (a skipped one counts as a plain test) ~30 s; a 5 s; then by tests
    assert [i.nodeid for i in ordered] == [
        "tests/long.py::t1", "tests/new.py::t1", "tests/new.py::t2", "tests/a.py::t1", "tests/a.py::t2",
        "tests/many.py::t1", "tests/many.py::t2", "tests/many.py::t3", "tests/few.py::t1"]


def test_the_table_names_only_files_that_exist():
    seconds = json.loads(FILE_SECONDS.read_text())
    assert seconds and all(isinstance(s, (int, float)) and s > 0 for s in seconds.values())
    missing = [path for path in seconds if not (ROOT / path).is_file()]
    assert not missing, f"files in {FILE_SECONDS.name} that no longer exist (refresh it): {missing}"


def test_the_recorder_sums_each_files_phases_and_keeps_those_of_3_s_or_more(tmp_path):
    recorder = FileSecondsRecorder(tmp_path / "seconds.json")

    class _Report:
        def __init__(self, nodeid, duration):
            self.nodeid, self.duration = nodeid, duration

    for nodeid, duration in (("tests/a.py::t1", 2.0), ("tests/a.py::t2", 1.5), ("tests/b.py::t", 0.5)):
        recorder.pytest_runtest_logreport(_Report(nodeid, duration))
    recorder.pytest_sessionfinish(None)
    assert json.loads((tmp_path / "seconds.json").read_text()) == {"tests/a.py": 4}  # 3.5 s rounds; b under 3 s
