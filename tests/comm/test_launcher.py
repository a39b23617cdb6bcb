"""The one launcher: both supervision policies on tiny Python ranks (no torch in the children)."""

from __future__ import annotations

import sys
import time

import pytest

from xstage_dit.comm.launcher import launch

# Rank 1 exits 3 at once; rank 0 exits 0 after `delay` seconds (or sleeps far longer than any test).
RANKS = "import os, sys, time; r = int(os.environ['RANK']); time.sleep({delay} if r == 0 else 0); sys.exit(0 if r == 0 else 3)"


def test_any_policy_returns_the_failing_rank_and_stops_the_others():
    t0 = time.monotonic()
    assert launch(2, [sys.executable, "-c", RANKS.format(delay=600)], timeout_s=60, grace_s=2) == 3
    assert time.monotonic() - t0 < 30, "rank 0 should have been stopped at once"


def test_any_policy_reports_the_rank_that_failed_first_not_the_lowest():
    # Rank 1 fails, and rank 0 fails 50 ms later as a consequence (a collective losing its peer), both
    # within one 1 s poll: the code is rank 1's, the cause, as `launch` saw the exits happen.
    ranks = "import os, sys, time; r = int(os.environ['RANK']); time.sleep(0.05 if r == 0 else 0); sys.exit(1 if r == 0 else 3)"
    assert launch(2, [sys.executable, "-c", ranks], timeout_s=60, grace_s=2, poll_s=1.0) == 3


def test_leader_policy_lets_rank0_decide(capfd):
    assert launch(2, [sys.executable, "-c", RANKS.format(delay=1.0)], policy="leader", timeout_s=60) == 0
    err = capfd.readouterr().err
    assert "started 2 ranks" in err and "rank 1" in err and "exited with code 3" in err


def test_timeout_and_bad_arguments():
    assert launch(1, [sys.executable, "-c", "import time; time.sleep(600)"], timeout_s=0.5, grace_s=1) == 124
    with pytest.raises(ValueError, match="policy"):
        launch(1, [sys.executable, "-c", "pass"], policy="some")
    with pytest.raises(ValueError, match="empty argv"):
        launch(1, [])
