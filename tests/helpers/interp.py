"""Triton interpreter cases run in a child process (TRITON_INTERPRET=1 must be set before triton is imported, and
the interpreter's state must not leak into the test process): the script prints one JSON object as its last
line, which `run_interp_script` returns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interp_script(script: Path, timeout: float = 300) -> dict:
    """Run `script` under the Triton interpreter with the checkout importable; its last stdout line, parsed."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
