"""The tests' rank launcher (`tests.helpers.preloaded`): ranks forked from the preloaded server run their program as
``__main__`` with the launcher's environment and their argv, find the libraries already imported, and are
supervised as `xstage_dit.comm.launcher.launch` does ("any" policy, 124 on timeout)."""

from __future__ import annotations

import json
import os
import time

from tests.helpers.preloaded import launch_preloaded

# Writes what the rank saw to OUT.<rank>; with a code, rank 1 exits with it at once and rank 0 sleeps on.
PROGRAM = """
import json, os, sys, time
preloaded = sorted(m for m in ("torch", "diffusers", "transformers", "xstage_dit.families") if m in sys.modules)
out, code = sys.argv[1], int(sys.argv[2])
with open(f"{out}.{os.environ['RANK']}", "w") as f:
    json.dump({"name": __name__, "argv": sys.argv[1:], "rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"],
               "port": os.environ["MASTER_PORT"], "preloaded": preloaded, "mine": os.environ.get("MINE")}, f)
print("rank", os.environ["RANK"], "done")
if code and os.environ["RANK"] == "1":
    sys.exit(code)
if code:
    time.sleep(600)
"""


def _program(tmp_path):
    path = tmp_path / "program.py"
    path.write_text(PROGRAM)
    return path


def test_ranks_run_the_program_with_their_environment_and_the_imports_done(tmp_path, capfd):
    out = tmp_path / "seen"
    code = launch_preloaded(2, _program(tmp_path), [str(out), "0"], env=dict(os.environ, MINE="x"), timeout_s=120,
                            logs=out)
    assert code == 0
    seen = [json.loads((tmp_path / f"seen.{r}").read_text()) for r in range(2)]
    assert [s["rank"] for s in seen] == ["0", "1"] and {s["world"] for s in seen} == {"2"}
    assert len({s["port"] for s in seen}) == 1
    for s in seen:
        assert s["name"] == "__main__" and s["argv"] == [str(out), "0"] and s["mine"] == "x", s
        assert s["preloaded"] == ["diffusers", "torch", "transformers", "xstage_dit.families"], s
    err = capfd.readouterr().err
    assert "--- rank 0 ---\nrank 0 done" in err and "--- rank 1 ---\nrank 1 done" in err  # their output, echoed


def test_a_failing_rank_stops_the_others_and_a_timeout_is_124(tmp_path):
    program, out = _program(tmp_path), tmp_path / "seen"
    t0 = time.monotonic()
    assert launch_preloaded(2, program, [str(out), "3"], env=dict(os.environ), timeout_s=120, logs=out) == 3
    assert time.monotonic() - t0 < 30, "rank 0 should have been stopped at once"
    t0 = time.monotonic()
    assert launch_preloaded(1, program, [str(out), "3"], env=dict(os.environ), timeout_s=1, logs=out) == 124
    assert time.monotonic() - t0 < 30
