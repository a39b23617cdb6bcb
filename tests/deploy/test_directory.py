"""The shared job directory (`deploy.directory.JobDirectory`) on its own, without Ray: records by sequence number,
the long polls of owners and readers, commands for owners, owners that vanish, expiry, and metrics gathering."""

from __future__ import annotations

import asyncio

import pytest

from xstage_dit.deploy.directory import JobDirectory


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rec(job_id: str, seq: int, status: str = "queued", **fields) -> dict:
    return {"id": job_id, "seq": seq, "status": status, "created": 1000.0, "finished": fields.pop("finished", None),
            **fields}


def run(coro):
    return asyncio.run(coro)


def test_records_only_move_forward_and_unknown_updates_are_refused():
    async def scenario():
        d = JobDirectory(clock=Clock())
        await d.register("a", "video", ["item"], rec("v1", 1))
        assert await d.update("a", rec("v1", 3, "in_progress"))
        assert await d.update("a", rec("v1", 2, "queued"))  # known, but older: kept as it was
        view = await d.get("v1")
        assert view["record"]["status"] == "in_progress" and view["items"] == ["item"] and not view["has_content"]
        assert not await d.update("a", rec("nope", 1))  # the owner registers it again
        assert await d.update("a", rec("v1", 4, "completed", finished=1001.0), b"mp4")
        assert (await d.get("v1"))["has_content"] and await d.content("v1") == b"mp4"
        assert await d.get("nope") is None and await d.content("nope") is None

    run(scenario())


def test_watch_wakes_on_a_newer_record_and_times_out_otherwise():
    async def scenario():
        d = JobDirectory()
        await d.register("a", "video", [], rec("v1", 1))
        waiting = asyncio.create_task(d.watch("v1", 1, timeout_s=5.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await d.update("a", rec("v1", 2, "in_progress"))
        assert (await asyncio.wait_for(waiting, 1.0))["record"]["seq"] == 2
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert (await d.watch("v1", 2, timeout_s=0.1))["record"]["seq"] == 2
        assert loop.time() - started >= 0.09
        gone = asyncio.create_task(d.watch("v1", 2, timeout_s=5.0))
        await asyncio.sleep(0.05)
        assert await d.forget("v1")
        assert await asyncio.wait_for(gone, 1.0) is None  # deleted: the watcher learns at once

    run(scenario())


def test_cancel_and_forget_reach_the_owner_through_its_poll():
    async def scenario():
        d = JobDirectory()
        await d.register("a", "video", [], rec("v1", 1, "in_progress"))
        poll = asyncio.create_task(d.poll("a", {"state": "ready"}, ["v1"], timeout_s=5.0))
        await asyncio.sleep(0.05)
        assert not poll.done()  # nothing for it yet: a long poll
        assert await d.cancel("v1")
        assert (await asyncio.wait_for(poll, 1.0)) == {"commands": [("cancel", "v1")], "missing": []}
        await d.update("a", rec("v1", 2, "cancelled", finished=1000.0))
        assert not await d.cancel("v1")  # ended: nothing to cancel
        assert await d.forget("v1") and await d.get("v1") is None and not await d.forget("v1")
        assert (await d.poll("a", {}, [], timeout_s=0.0))["commands"] == [("forget", "v1")]
        assert not await d.cancel("v9")

    run(scenario())


def test_a_recreated_directory_names_what_an_owner_holds_that_it_lacks():
    async def scenario():
        d = JobDirectory()
        answer = await d.poll("a", {"state": "ready"}, ["v1", "v2"], timeout_s=5.0)  # returns at once
        assert answer == {"commands": [], "missing": ["v1", "v2"]}
        await d.register("a", "video", [], rec("v1", 7))
        assert (await d.poll("a", {}, ["v1"], timeout_s=0.0))["missing"] == []

    run(scenario())


def test_an_owner_that_stops_polling_is_dropped_and_its_unfinished_jobs_fail_503():
    async def scenario():
        clock = Clock()
        d = JobDirectory(owner_lost_s=10.0, clock=clock)
        await d.poll("a", {"state": "ready"}, [], timeout_s=0.0)
        await d.poll("b", {"state": "ready"}, [], timeout_s=0.0)
        await d.register("a", "video", [], rec("running", 1, "in_progress"))
        await d.register("a", "video", [], rec("done", 1, "completed", finished=1000.0))
        clock.now += 5.0
        await d.poll("b", {"state": "ready"}, [], timeout_s=0.0)
        assert set(await d.replicas()) == {"a", "b"}
        clock.now += 6.0  # a: 11 s without a poll
        assert set(await d.replicas()) == {"b"}
        lost = (await d.get("running"))["record"]
        assert lost["status"] == "failed" and lost["error_code"] == 503 and "replica a" in lost["error"]
        assert lost["seq"] == 2 and (await d.get("done"))["record"]["status"] == "completed"
        await d.register("b", "video", [], rec("b1", 1, "queued"))
        await d.leave("b")
        assert (await d.get("b1"))["record"]["status"] == "failed" and await d.replicas() == {}

    run(scenario())


def test_ended_jobs_expire_after_the_ttl_and_beyond_the_store_size():
    async def scenario():
        clock = Clock()
        d = JobDirectory(job_ttl_s=100.0, max_stored_jobs=2, clock=clock)
        for i in range(3):
            await d.register("a", "video", [], rec(f"v{i}", 1, "completed", finished=1000.0 + i))
        await d.register("a", "video", [], rec("live", 1, "in_progress"))
        await d.poll("a", {}, [], timeout_s=0.0)
        assert [v["record"]["id"] for v in await d.listing("video")] == ["v2", "live"]  # the oldest ended went
        clock.now += 10.0
        await d.register("a", "video", [], rec("new", 1, "completed", finished=clock.now))
        clock.now += 50.0
        await d.poll("a", {}, [], timeout_s=0.0)
        assert {v["record"]["id"] for v in await d.listing("video")} == {"live", "new"}
        clock.now += 60.0  # "new" ended 110 s ago: past the TTL
        await d.poll("a", {}, [], timeout_s=0.0)
        assert [v["record"]["id"] for v in await d.listing("video")] == ["live"]
        assert await d.listing("image") == []
        await d.register("a", "video", ["image of the first frame"], rec("i2v", 1, "in_progress"))
        views = {v["record"]["id"]: v for v in await d.listing("video", held=["i2v"])}
        assert views["i2v"]["items"] is None and views["live"]["items"] == []  # the caller holds i2v's items

    run(scenario())


def test_gather_metrics_asks_every_other_owner_and_waits_for_their_reports():
    async def scenario():
        d = JobDirectory()
        for owner in ("a", "b", "c"):
            await d.poll(owner, {}, [], timeout_s=0.0)

        async def owner_loop(owner: str, answers: bool) -> None:
            commands = (await d.poll(owner, {}, [], timeout_s=2.0))["commands"]
            for verb, token in commands:
                if verb == "metrics" and answers:
                    await d.report_metrics(owner, token, f"x_total{{}} {ord(owner)}\n")

        loops = [asyncio.create_task(owner_loop("b", True)), asyncio.create_task(owner_loop("c", False))]
        await asyncio.sleep(0.05)
        reports = await d.gather_metrics("a", timeout_s=0.3)  # c never answers: left out after the wait
        assert reports == {"b": "x_total{} 98\n"}
        await asyncio.gather(*loops)

    run(scenario())


def test_owner_lost_must_outlast_a_poll():
    with pytest.raises(ValueError, match="owner_lost_s"):
        JobDirectory(owner_lost_s=1.0)
