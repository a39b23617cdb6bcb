"""Issue 16, items 3 and 9 on the scripts: the package metadata builds without setuptools deprecation
banners, scripts/env.sh says what each install step does and lets pip show its progress, and
`./scripts/test.sh -q` keeps pytest's closing summary line. The scripts run for real, in a copy of the
repo's layout whose venv is a stand-in that records the pip calls (nothing is installed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_metadata_builds_without_deprecation_warnings(tmp_path):
    # What pip runs first on `pip install -e .`: setuptools' metadata hook, here with warnings as errors.
    code = ("import sys; from setuptools import build_meta; "
            "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))")
    done = subprocess.run([sys.executable, "-W", "error", "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Deprecat" not in done.stderr, done.stderr[-3000:]
    metadata = (tmp_path / done.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    import xstage_dit

    assert "License-Expression: Apache-2.0" in metadata
    assert f"Version: {xstage_dit.__version__}" in metadata
    assert "schemathesis==" in metadata and "fastapi-offline==" in metadata


def _fake_layout(tmp_path: Path, script: str, pip_fails_on: str = "") -> Path:
    """tmp/scripts/<script> copied from the repo, pyproject.toml, and a .venv whose `python` logs its
    arguments and otherwise runs the real interpreter (so pytest really runs); its pip succeeds, except a pip call
    whose arguments contain `pip_fails_on`, which fails as a full disk does."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / script, tmp_path / "scripts" / script)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    if script != "env.sh":
        (tmp_path / "scripts" / "env.sh").write_text(f'export PATH="{tmp_path}/.venv/bin:$PATH"\n')
    bindir = tmp_path / ".venv" / "bin"
    bindir.mkdir(parents=True)
    log = tmp_path / "calls.log"
    (bindir / "python").write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        echo "$*" >> {log}
        if [ -n "{pip_fails_on}" ] && [[ "$*" == *"{pip_fails_on}"* ]]; then
          echo "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device" >&2; exit 1
        fi
        if [ "$1 $2" = "-m pip" ]; then echo "pip progress: $*"; exit 0; fi
        exec {sys.executable} "$@"
        """))
    (bindir / "python").chmod(0o755)
    (bindir / "activate").write_text(f'export PATH="{bindir}:$PATH"\n')
    return log


def test_env_sh_announces_each_step_and_shows_pip_progress(tmp_path):
    log = _fake_layout(tmp_path, "env.sh")
    done = subprocess.run(["bash", "-c", f". {tmp_path}/scripts/env.sh"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": os.environ["PATH"]})
    assert done.returncode == 0, done.stderr
    steps = [line for line in done.stderr.splitlines() if line.startswith("env.sh: step")]
    assert [s.split(":")[1].strip() for s in steps] == ["step 1/3", "step 2/3", "step 3/3"], done.stderr
    pip_calls = [line for line in log.read_text().splitlines() if line.startswith("-m pip install")]
    assert len(pip_calls) >= 2, pip_calls  # pip itself and the project (torch is already there)
    for call in pip_calls:
        assert " -q" not in f" {call}" and "--progress-bar on" in call, call
    assert "pip progress" in done.stdout  # pip's own output reaches the terminal
    assert (tmp_path / ".venv" / ".xstage-installed").is_file()
    again = subprocess.run(["bash", "-c", f". {tmp_path}/scripts/env.sh"], capture_output=True, text=True, timeout=60)
    assert "step" not in again.stderr  # installed once: the second run is silent and quick


def test_a_failed_install_stops_even_inside_an_and_list_and_leaves_the_venv_unmarked(tmp_path):
    """.ci/run sources env.sh in `. scripts/env.sh && lint-imports`, where bash ignores `set -e`: a failed pip
    (a full disk, as on 2026-12-07) must still stop there, say so, and not stamp the .venv as installed."""
    _fake_layout(tmp_path, "env.sh", pip_fails_on="[test]")
    done = subprocess.run(["bash", "-c", f". {tmp_path}/scripts/env.sh && echo went on"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and "went on" not in done.stdout, done.stdout + done.stderr
    assert "No space left on device" in done.stderr
    assert "env.sh: error: the install into .venv failed" in done.stderr and "is ready" not in done.stderr
    assert not (tmp_path / ".venv" / ".xstage-installed").exists()


def test_test_sh_keeps_the_pytest_summary_line_with_q(tmp_path):
    _fake_layout(tmp_path, "test.sh")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_one.py").write_text("def test_one():\n    pass\n")
    for extra in ([], ["-q"]):
        done = subprocess.run(["bash", str(tmp_path / "scripts" / "test.sh"), *extra, "-p", "no:cacheprovider",
                               "tests"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        last = done.stdout.strip().splitlines()[-1]
        assert last.startswith("1 passed"), f"test.sh {extra}: expected the summary line last, got {last!r}"
