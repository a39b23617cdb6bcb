"""A bench stopped by SIGTERM (a device call's time limit) writes the row it was measuring: bench.interrupt."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time


def test_sigterm_mid_row_writes_an_interrupted_row_and_exits_143(tmp_path):
    # 5,000 tiny steps: the row is still running when the signal comes (~2 ms a step on a CPU)
    bench = subprocess.Popen([sys.executable, "-m", "xstage_dit.bench.e2e", "--model", "tiny-flux", "--num-prompts",
                              "1", "--steps", "5000", "--contenders", "diffusers", "--out-dir", str(tmp_path)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in bench.stdout:
            seen.append(line)
            if "[bench] diffusers: running" in line:
                time.sleep(0.5)
                bench.send_signal(signal.SIGTERM)
                break
        out, _ = bench.communicate(timeout=120)
    finally:
        bench.kill()
    assert bench.returncode == 128 + signal.SIGTERM, "".join(seen) + (out or "")
    rows = json.loads((tmp_path / "e2e-tiny-flux-1xcpu.json").read_text(encoding="utf-8"))["rows"]
    assert [(r["name"], r["status"]) for r in rows] == [("diffusers", "interrupted")], rows
    assert rows[0]["reason"].startswith("stopped by SIGTERM after ") and rows[0]["interrupted_after_s"] >= 0.5
    assert rows[0]["dynamo_frames_so_far"] == 0  # eager: nothing compiled
    assert "| diffusers | interrupted |" in (tmp_path / "e2e-tiny-flux-1xcpu.md").read_text(encoding="utf-8")
