"""benchmarks/device.sh, the one device runner: every step it defines is listed (header and the unknown-step
message), every script it runs exists, and every subcommand it names is one its entry script dispatches."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "benchmarks" / "device.sh"


def _text() -> str:
    return RUNNER.read_text(encoding="utf-8")


def test_device_runner_parses():
    subprocess.run(["bash", "-n", str(RUNNER)], check=True)


def test_every_step_is_listed_in_the_header_and_the_error_message():
    text = _text()
    defined = {name.replace("_", "-") for name in re.findall(r"^step_(\w+)\(\)", text, re.MULTILINE)}
    listed = set(re.search(r"unknown step '\$step' \(([^)]*)\)", text).group(1).split())
    header = text.split("\nset -uo pipefail", 1)[0]
    documented = set(re.findall(r"^#   ([a-z0-9-]+) ", header, re.MULTILINE))
    assert defined == listed, f"steps defined {sorted(defined)} vs listed {sorted(listed)}"
    assert defined <= documented, f"steps without a line in the header: {sorted(defined - documented)}"


def test_every_script_the_runner_runs_exists():
    cited = set(re.findall(r"\b((?:benchmarks|scripts|tests)/[\w/.-]+\.(?:py|sh))\b", _text()))
    assert cited, "expected the runner to name its scripts"
    missing = sorted(p for p in cited if not (ROOT / p).is_file())
    assert not missing, f"device.sh names scripts that do not exist: {missing}"


def test_every_subcommand_the_runner_names_is_dispatched():
    from benchmarks import bench_serving

    for module in bench_serving.SUBCOMMANDS.values():
        assert callable(__import__(f"benchmarks.{module}", fromlist=["main"]).main), module
    used = set(re.findall(r"benchmarks/bench_serving\.py ([a-z-]+)", _text()))
    assert used and used <= set(bench_serving.SUBCOMMANDS), used - set(bench_serving.SUBCOMMANDS)
    assert re.findall(r"benchmarks/bench_e2e\.py ([a-z][a-z-]*)", _text()) == ["sync-points"]  # not an --option


def test_no_one_off_probe_scripts_accumulate():
    # STYLE 16: one bench_<op>.py per op; what a one-off measured is a subcommand of its op's script or a note.
    strays = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")
                    if p.name.startswith(("probe_", "diag_", "run_", "refit_")))
    assert not strays, f"one-off scripts in benchmarks/: {strays}"
