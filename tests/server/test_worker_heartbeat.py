"""A follower's heartbeat (`server.worker.Worker._heartbeat`): rank 0's store gone means the follower exits 1, unless
rank 0 already told it to stop. Then rank 0 exits while the follower restores its stack, and that is a clean end
(a CI run saw a follower exit 1 there: the OOM test's shutdown, 2026-12-07)."""

from __future__ import annotations

import types

import pytest

from xstage_dit.server import worker as worker_module
from xstage_dit.server.config import ServerConfig
from xstage_dit.server.worker import Worker


class _Exited(Exception):
    pass


@pytest.fixture
def follower(monkeypatch):
    def gone(ctx, port, is_master):
        raise RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed.")

    def exit_(code):
        raise _Exited(code)

    monkeypatch.setattr(worker_module, "_store", gone)
    monkeypatch.setattr(worker_module.os, "_exit", exit_)
    w = Worker(lambda ctx: None, ServerConfig(api_key=None))
    w.ctx = types.SimpleNamespace(rank=1)
    return w


def test_a_lost_rank_0_ends_the_follower_with_1(follower):
    with pytest.raises(_Exited) as exited:
        follower._heartbeat(1234)
    assert exited.value.args == (1,)


def test_after_stop_rank_0_leaving_is_no_loss(follower):
    follower._stop.set()
    follower._heartbeat(1234)  # returns: no exit
