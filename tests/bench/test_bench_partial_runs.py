"""A bench run over several device calls: SIGTERM writes the row in progress (bench.interrupt), and --resume keeps
an earlier call's rows and measures the rest."""

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
    assert set(rows[0]["compile_s_so_far"]) >= {"total", "inductor"} and rows[0]["compile_s_so_far"]["total"] == 0
    assert "| diffusers | interrupted |" in (tmp_path / "e2e-tiny-flux-1xcpu.md").read_text(encoding="utf-8")


def test_resume_keeps_the_measured_rows_and_measures_the_rest(tmp_path):
    from xstage_dit import cli

    first = ["bench", "--model", "tiny-flux", "--num-prompts", "1", "--steps", "2", "--out-dir", str(tmp_path)]
    assert cli.main(first + ["--contenders", "diffusers,xstage-serial"]) == 0
    path = tmp_path / "e2e-tiny-flux-1xcpu.json"
    before = {r["name"]: r for r in json.loads(path.read_text(encoding="utf-8"))["rows"]}
    # the second call keeps the first one's rows (same numbers, marked) and measures only xstage-calibrated
    assert cli.main(first + ["--contenders", "diffusers,xstage-serial,xstage-calibrated", "--resume", str(path)]) == 0
    doc = json.loads(path.read_text(encoding="utf-8"))
    rows = {r["name"]: r for r in doc["rows"]}
    eager = [n for n in rows if "+compile" not in n]  # the compiled variants: listed as skipped, not asked for
    assert eager == ["diffusers", "xstage-serial", "diffusers-repeat", "xstage-calibrated"], list(rows)
    for name in ("diffusers", "xstage-serial", "diffusers-repeat"):
        assert rows[name]["resumed"] and rows[name]["latencies_s"] == before[name]["latencies_s"], name
        assert "earlier call this run resumed" in rows[name]["note"]
    assert rows["xstage-calibrated"]["status"] == "ok" and "resumed" not in rows["xstage-calibrated"]
    assert doc["summary"]["settings"]["resumed_from"]["path"] == str(path)
    assert "xstage-calibrated" in doc["summary"]["contenders"]


def test_resume_refuses_another_run_naming_the_difference(tmp_path, capsys):
    import pytest

    from xstage_dit import cli

    base = ["bench", "--model", "tiny-flux", "--num-prompts", "1", "--out-dir", str(tmp_path), "--contenders",
            "diffusers"]
    assert cli.main(base + ["--steps", "2"]) == 0
    path = str(tmp_path / "e2e-tiny-flux-1xcpu.json")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        cli.main(base + ["--steps", "3", "--resume", path])
    assert exited.value.code == 2
    assert f"expected --resume '{path}' to have run with this run's steps 3, got 2" in capsys.readouterr().err
