"""Replicas of the engine on Ray Serve, on the CPU: a local Ray cluster, tiny models, gloo ranks.

- two replicas of sp = 2 (tiny FLUX): 50 concurrent seeded requests each get their own seed's image, byte-identical
  to the single-process image, and both replicas serve some; ``/health`` and ``/metrics`` cover both;
- one rank of one replica killed under load: its in-flight requests are answered 503 (those running) or retried on
  the other replica (those that never started, said in the answer), every other request is answered, Serve
  restarts the replica, and ``/health`` stays 200 (the other replica is ready) until both are ready again within
  `RESTART_BOUND_S`;
- two replicas of tiny Wan: a video job created through one replica is polled, streamed, listed, downloaded,
  cancelled and deleted through the other;
- a scale-down drains the removed replica's video job;
- autoscaling from 1 to 2 replicas under load and back to 1, every request answered 200;
- ``xstage-dit serve --replicas 1``: the command starts its own local cluster, answers, and exits 0 on SIGTERM.

One file, so that pytest-xdist (``--dist loadfile``) never runs two Ray clusters at once; the command's test comes
first, before the module's cluster starts. One cluster for the rest (at most 4 rank processes at a time: the
machine has 2 cores); each class deploys its application and deletes it. The times are printed (pytest -s)."""

from __future__ import annotations

import base64
import concurrent.futures as cf
import contextlib
import dataclasses
import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.helpers.ray_cluster import deploy, ray_cluster, replica_of, running_replicas, single_process_pngs
from tests.helpers.server import assert_same_image, decode_png, multirank_server
from xstage_dit.deploy import Autoscaling, DeployOptions
from xstage_dit.deploy.ingress import RETRIED_HEADER

pytestmark = pytest.mark.slow

RESTART_BOUND_S = 150.0  # kill -> both replicas ready again, on this 2-core machine (measured about 40 s)
PROMPT = "a red fox in the snow"


def options(model: str, sp: int = 1, **fields) -> DeployOptions:
    args = {"model": model, "sp": sp, "gpus_per_rank": 0, "max_batch_size": 1, "warmup": False, "gc_freeze": False,
            "health_check_period_s": 1, "routing_stats_period_s": 0.5, "heartbeat_timeout_s": 3,
            "graceful_shutdown_timeout_s": 60, **fields}
    return DeployOptions.from_args(args)


def test_serve_with_replicas_starts_ray_answers_and_stops_cleanly():
    started = time.monotonic()
    with multirank_server("--replicas", "1", "--gpus-per-rank", "0", "--no-warmup", "--log-level", "warning",
                          sp=1, log_name="serve-replicas", ready_within_s=240) as (client, proc, log):
        ready_s = time.monotonic() - started
        health = client.get("/health")
        assert health.json()["ready_replicas"] == 1 and health.json()["replica"] == replica_of(health)
        r = client.post("/v1/images/generations", json={"prompt": PROMPT, "seed": 3, "size": "32x32",
                                                        "num_inference_steps": 2})
        assert r.status_code == 200 and r.json()["data"][0]["seed"] == 3 and replica_of(r) == replica_of(health)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        log.seek(0)
        assert code == 0, log.read()[-3000:]
    print(f"\nxstage-dit serve --replicas 1: ready in {ready_s:.1f} s, stopped cleanly")


@pytest.fixture(scope="module")
def cluster():
    started = time.monotonic()
    with ray_cluster() as url:
        print(f"\nRay cluster up in {time.monotonic() - started:.1f} s")
        yield url


@pytest.fixture(scope="class")
def flux(cluster):
    from ray import serve

    print(f"\n2 x sp=2 tiny-flux ready in {deploy(options('tiny-flux', sp=2, replicas=2)):.1f} s")
    with httpx.Client(base_url=cluster, timeout=180) as client:
        print(f"both replicas routed to after {routed_to_both(client):.1f} s more")
        yield client
    serve.delete("xstage")


def routed_to_both(client: httpx.Client, timeout_s: float = 60.0) -> float:
    """Seconds until concurrent ``/health`` calls have been answered by two replicas. Serve reports the application
    running once its replicas are, but the proxy learns of them by long poll: a burst sent at once (CI, 2026-12-07:
    50 requests on a loaded 2-core machine) could all go to the one replica the proxy knew, which says nothing about
    the routing the tests check, only that it had not caught up yet."""
    started, seen = time.monotonic(), set()
    with cf.ThreadPoolExecutor(8) as pool:
        while len(seen) < 2:
            assert time.monotonic() - started < timeout_s, f"only {seen} answered within {timeout_s:.0f} s"
            seen |= {replica_of(r) for r in pool.map(lambda _: client.get("/health"), range(8))}
    return time.monotonic() - started


def _image(response: httpx.Response) -> bytes:
    return base64.b64decode(response.json()["data"][0]["b64_json"])


def png_pixels(png: bytes):
    return decode_png(base64.b64encode(png).decode())


class TestTwoReplicasOfSp2:
    def test_fifty_concurrent_requests_get_their_own_seed_image(self, flux):
        seeds = list(range(50))
        started = time.monotonic()
        with cf.ThreadPoolExecutor(50) as pool:
            answers = list(pool.map(lambda s: flux.post("/v1/images/generations", json={
                "prompt": PROMPT, "seed": s, "size": "32x32", "num_inference_steps": 2}), seeds))
        took = time.monotonic() - started
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200][:3]
        served_by = {replica_of(r) for r in answers}
        assert len(served_by) == 2, f"expected both replicas to serve some, got only {served_by}"
        want = single_process_pngs(PROMPT, seeds, 32, 2)
        wrong = [s for s, r in zip(seeds, answers) if _image(r) != want[s]]
        assert not wrong, f"seeds whose image differs from the single-process PNG: {wrong}"
        print(f"50 concurrent requests answered in {took:.1f} s by {sorted(served_by)}")

    def test_health_and_metrics_cover_every_replica(self, flux):
        health = flux.get("/health")
        assert health.status_code == 200, health.text
        body = health.json()
        assert body["ready_replicas"] == 2 and len(body["replicas"]) == 2 and body["world_size"] == 2
        assert all(len(r["ranks"]) == 2 for r in body["replicas"].values()), body["replicas"]
        metrics = flux.get("/metrics")
        assert metrics.status_code == 200
        sizes = [line for line in metrics.text.splitlines() if line.startswith("xstage_world_size{")]
        labelled = {line.split('replica="')[1].split('"')[0] for line in sizes}
        assert labelled == set(body["replicas"]), (sizes, body["replicas"])

    def test_killed_rank_answers_503_or_retries_and_the_replica_comes_back(self, flux):
        seeds = list(range(100, 124))
        body = {"prompt": PROMPT, "size": "256x256", "num_inference_steps": 16}
        with watching_health(str(flux.base_url)) as health_codes:
            with cf.ThreadPoolExecutor(len(seeds)) as pool:
                futures = {s: pool.submit(flux.post, "/v1/images/generations", json={**body, "seed": s})
                           for s in seeds}
                victim, pid = replica_with_work_waiting(flux)
                killed_at = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                answers = {s: f.result(timeout=300) for s, f in futures.items()}
            answered_s = time.monotonic() - killed_at
            restarted_s = wait_for_replacement(flux, victim, killed_at)
        codes = {s: r.status_code for s, r in answers.items()}
        assert set(codes.values()) <= {200, 503}, codes
        failed = [r for r in answers.values() if r.status_code == 503]
        assert all("rank" in r.json()["error"]["message"] and replica_of(r) == victim for r in failed), \
            [r.text for r in failed]
        retried = {s: r for s, r in answers.items() if RETRIED_HEADER.decode() in r.headers}
        assert retried, "expected the victim's waiting requests to be retried on the other replica, got " + \
            str({code: sorted(s for s in codes if codes[s] == code) for code in set(codes.values())})
        assert all(r.status_code == 200 and replica_of(r) != victim and r.headers[RETRIED_HEADER.decode()]
                   .startswith(victim) for r in retried.values()), {s: dict(r.headers) for s, r in retried.items()}
        ok = {s: r for s, r in answers.items() if r.status_code == 200}
        # At 256x256 and 16 steps the sequence split reassociates enough fp32 sums to move a pixel by one level
        # (TOL.image_levels); another seed's image differs by far more.
        want = single_process_pngs(PROMPT, sorted(ok), 256, 16)
        for s, r in ok.items():
            assert_same_image(decode_png(r.json()["data"][0]["b64_json"]), png_pixels(want[s]), f"seed {s}")
        assert health_codes and all(code == 200 for code, _ in health_codes), health_codes
        again = flux.post("/v1/images/generations", json={**body, "seed": 1, "size": "32x32"})
        assert again.status_code == 200, again.text
        print(f"rank 1 of {victim} killed: {len(failed)} answered 503, {len(retried)} retried, {len(ok)} answered "
              f"200, all within {answered_s:.1f} s; both replicas ready again after {restarted_s:.1f} s, /health "
              f"200 throughout ({len(health_codes)} checks)")


@contextlib.contextmanager
def watching_health(url: str):
    """GET /health every half second while the block runs; yields the (status, body start) list."""
    codes: list[tuple[int, str]] = []
    stop = threading.Event()

    def watch() -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            while not stop.is_set():
                r = client.get("/health")
                codes.append((r.status_code, r.text[:200]))
                stop.wait(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield codes
    finally:
        stop.set()
        watcher.join(timeout=30)


def replica_with_work_waiting(client: httpx.Client, timeout_s: float = 60.0, waiting: int = 2) -> tuple[str, int]:
    """The first replica seen running a request with `waiting` more queued (its poll state, at most 2 s old), and the
    pid of its rank 1. Whichever it is: Serve's router may load one replica and leave the other nearly idle (a CI run
    saw the first-named replica run one request at a time and never queue one), so the victim is not fixed. Two
    waiting, not one: with the state up to 2 s old, a single waiting request had started by the kill on a loaded
    CI run, and nothing was left to retry."""
    deadline = time.monotonic() + timeout_s
    seen: dict[tuple[int, int], int] = {}  # (running, waiting) -> polls, over every replica, for a failure
    while True:
        for name, state in client.get("/health").json()["replicas"].items():
            if state["running"] >= 1 and state["queue_depth"] >= waiting:
                return name, next(r["pid"] for r in state["ranks"] if r["rank"] == 1)
            key = (state["running"], state["queue_depth"])
            seen[key] = seen.get(key, 0) + 1
        assert time.monotonic() < deadline, f"no replica ever had work waiting; polls by (running, waiting): {seen}"
        time.sleep(0.1)


def wait_for_replacement(client: httpx.Client, victim: str, since: float) -> float:
    """Seconds from `since` until two replicas are ready and the victim is gone (Serve replaced it)."""
    while True:
        health = client.get("/health").json()
        if health["ready_replicas"] == 2 and victim not in health["replicas"]:
            return time.monotonic() - since
        assert time.monotonic() - since < RESTART_BOUND_S, f"not two ready replicas {RESTART_BOUND_S:.0f} s after " \
                                                           f"the kill: {health['replicas']}"
        time.sleep(0.2)


@pytest.fixture(scope="class")
def wan(cluster):
    from ray import serve

    print(f"\n2 x sp=1 tiny-wan ready in {deploy(options('tiny-wan', replicas=2)):.1f} s")
    with httpx.Client(base_url=cluster, timeout=180) as client:
        yield client
    serve.delete("xstage")


def _elsewhere(client: httpx.Client, owner: str, method: str, path: str, tries: int = 40) -> httpx.Response:
    """`method path` answered by a replica other than `owner` (Serve routes each request to either)."""
    for _ in range(tries):
        r = client.request(method, path)
        if replica_of(r) != owner:
            return r
    raise AssertionError(f"{method} {path}: every one of {tries} answers came from the owner {owner}")


def _events_elsewhere(client: httpx.Client, owner: str, path: str) -> tuple[str, list[tuple[str, dict]]]:
    for _ in range(40):
        with client.stream("GET", path) as r:
            if replica_of(r) == owner:
                continue
            events, name = [], None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    name = line[len("event: "):]
                elif line.startswith("data: "):
                    events.append((name, json.loads(line[len("data: "):])))
            return replica_of(r), events
    raise AssertionError(f"GET {path}: every answer came from the owner {owner}")


def _create(client: httpx.Client, **body) -> tuple[str, str]:
    """(owner replica, id) of a new video job."""
    created = client.post("/v1/videos", json={"prompt": "a cat walking", "size": "32x32", "num_frames": 5, **body})
    assert created.status_code == 202, created.text
    return replica_of(created), created.json()["id"]


def _once_elsewhere(client: httpx.Client, method: str, path: str, make_job, tries: int = 12):
    """`method path` (not idempotent) sent once for each new job of `make_job()` until a replica other than the
    job's owner answers it: (owner, job id, the answer)."""
    for _ in range(tries):
        owner, job_id = make_job()
        r = client.request(method, path.format(id=job_id))
        if replica_of(r) != owner:
            return owner, job_id, r
    raise AssertionError(f"{method} {path}: the owner answered each of {tries} tries")


class TestVideoJobsAcrossReplicas:
    def test_created_on_one_polled_streamed_and_downloaded_on_the_other(self, wan):
        owner, job_id = _create(wan, num_inference_steps=12, seed=4)
        reader, events = _events_elsewhere(wan, owner, f"/v1/videos/{job_id}/events")
        kinds = [name for name, _ in events]
        assert kinds[-1] == "completed" and events[-1][1]["status"] == "completed", events[-3:]
        steps = [data["steps_done"] for name, data in events if name == "progress"]
        assert steps == sorted(steps) and steps[-1] == 12, steps
        state = _elsewhere(wan, owner, "GET", f"/v1/videos/{job_id}")
        assert state.status_code == 200 and state.json()["status"] == "completed" and state.json()["progress"] == 100
        listed = _elsewhere(wan, owner, "GET", "/v1/videos")
        assert job_id in [v["id"] for v in listed.json()["data"]]
        mp4 = _elsewhere(wan, owner, "GET", f"/v1/videos/{job_id}/content")
        assert mp4.status_code == 200 and mp4.headers["content-type"] == "video/mp4" and mp4.content[4:8] == b"ftyp"
        thumb = _elsewhere(wan, owner, "GET", f"/v1/videos/{job_id}/content?variant=thumbnail")
        assert thumb.status_code == 200 and thumb.content[:8] == b"\x89PNG\r\n\x1a\n"
        mine = next(r for r in (wan.get(f"/v1/videos/{job_id}/content") for _ in range(40)) if replica_of(r) == owner)
        assert mine.content == mp4.content, "the MP4 differs between the owner and the other replica"
        print(f"video {job_id}: made by {owner}, streamed, polled, listed and downloaded through {reader}")

    def test_deleted_through_the_other_replica_is_gone_everywhere(self, wan):
        def completed() -> tuple[str, str]:
            owner, job_id = _create(wan, num_inference_steps=2)
            while wan.get(f"/v1/videos/{job_id}").json()["status"] != "completed":
                time.sleep(0.1)
            return owner, job_id

        owner, job_id, deleted = _once_elsewhere(wan, "DELETE", "/v1/videos/{id}", completed)
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True, deleted.text
        gone = [wan.get(f"/v1/videos/{job_id}") for _ in range(8)]
        assert all(r.status_code == 404 for r in gone), [(replica_of(r), r.status_code) for r in gone]
        assert {replica_of(r) for r in gone} > {owner}, "expected the owner among the replicas answering 404"

    def test_cancel_through_the_other_replica(self, wan):
        def running() -> tuple[str, str]:
            owner, job_id = _create(wan, size="256x256", num_frames=17, num_inference_steps=100)
            deadline = time.monotonic() + 60
            while wan.get(f"/v1/jobs/{job_id}").json().get("steps_done", 0) < 1:
                assert time.monotonic() < deadline, "the job never started"
                time.sleep(0.2)
            return owner, job_id

        owner, job_id, cancelled = _once_elsewhere(wan, "DELETE", "/v1/jobs/{id}", running)
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
        state = next(r for r in (wan.get(f"/v1/videos/{job_id}") for _ in range(40)) if replica_of(r) == owner)
        assert state.json()["status"] == "failed" and state.json()["error"]["code"] == "cancelled", state.text


class TestScaleDownDrains:
    def test_the_removed_replica_finishes_its_video_job_first(self, cluster):
        """Autoscaling starts two replicas; event streams held open (requests in flight) keep both while a long
        video job is made on each; once the streams close, Serve removes the newer replica after
        `downscale_delay_s` (a job whose POST was answered is no request in flight): it ends its job before it
        goes, and its MP4 is served by the one left."""
        from ray import serve

        scaling = Autoscaling(min_replicas=1, max_replicas=2, initial_replicas=2, target_ongoing_requests=1,
                              downscale_delay_s=6, metrics_interval_s=0.5, look_back_period_s=2)
        took = deploy(dataclasses.replace(options("tiny-wan"), autoscaling=scaling))
        print(f"\n2 x tiny-wan (autoscaled) ready in {took:.1f} s")
        try:
            with httpx.Client(base_url=cluster, timeout=180) as client:
                # Long enough to outlast the scale-down (streams closed + downscale_delay_s) on an idle 2-core
                # machine: 60 steps ended first there (CI, 2026-12-06).
                long_job = {"size": "256x256", "num_frames": 33, "num_inference_steps": 100}
                owner, job_id = _create(client, **long_job)
                jobs = {owner: job_id}  # owner -> its job
                with holding_streams(cluster, job_id, count=4):  # 4 in flight: autoscaling wants both replicas
                    # Bursts of concurrent creates: Serve sends each to the shorter queue of two replicas, so one
                    # create at a time can land on the same replica every time when the held streams sit on the
                    # other (seen on CI, 2026-12-06); a burst fills the first queue and reaches the second.
                    with cf.ThreadPoolExecutor(8) as pool:
                        for burst in range(6):
                            made = list(pool.map(lambda i: _create(client, **long_job, seed=1 + 8 * burst + i),
                                                 range(8)))
                            for owner, made_id in made:
                                if owner in jobs:
                                    client.delete(f"/v1/jobs/{made_id}")
                                else:
                                    jobs[owner] = made_id
                            if len(jobs) == 2:
                                break
                    assert len(jobs) == 2, f"expected a job on each replica, got {jobs}"
                stopping = _when_stopping(client, jobs)
                states = {owner: client.get(f"/v1/videos/{job_id}").json() for owner, job_id in jobs.items()}
                left = set(client.get("/health").json()["replicas"])
                # The kept replica's own long job has served its purpose (it held that replica busy): cancelled, so
                # its remaining steps neither compete with the rest of the test nor hold up `serve.delete`, whose
                # drain would wait for it (up to `graceful_shutdown_timeout_s`).
                for owner, job_id in jobs.items():
                    if owner in left:
                        client.delete(f"/v1/jobs/{job_id}")
                removed = [owner for owner in jobs if owner not in left]
                assert len(removed) == 1, (removed, jobs, left)
                assert stopping[removed[0]] != "completed", "its job had ended before the scale-down: no drain"
                assert states[removed[0]]["status"] == "completed", states  # the one left goes on with its own
                mp4 = client.get(f"/v1/videos/{jobs[removed[0]]}/content")
                assert mp4.status_code == 200 and mp4.content[4:8] == b"ftyp", mp4.text[:200]
                print(f"scale-down: replica {removed[0]} was stopped with its job {stopping[removed[0]]}; it ended "
                      f"the job, and its MP4 is served by {replica_of(mp4)}")
        finally:
            serve.delete("xstage")


@contextlib.contextmanager
def holding_streams(url: str, job_id: str, count: int):
    """`count` event streams of `job_id` held open while the block runs (requests in flight for autoscaling)."""
    stop = threading.Event()
    opened = threading.Semaphore(0)

    def hold() -> None:
        with httpx.Client(base_url=url, timeout=180) as client, client.stream("GET", f"/v1/jobs/{job_id}/events") as r:
            opened.release()
            for _ in r.iter_lines():  # a step's event or a keep-alive at least every 2 s
                if stop.is_set():
                    return

    threads = [threading.Thread(target=hold, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    for _ in threads:
        assert opened.acquire(timeout=30), "an event stream did not open"
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)


def _when_stopping(client: httpx.Client, jobs: dict[str, str], timeout_s: float = 120.0) -> dict[str, str]:
    """Wait until Serve stops a replica (scale-down): the jobs' statuses at that moment; then until it is gone."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    statuses = None
    while True:
        states = serve.status().applications["xstage"].deployments["engine"].replica_states
        if statuses is None and states.get("STOPPING", 0):
            statuses = {owner: client.get(f"/v1/videos/{job_id}").json()["status"] for owner, job_id in jobs.items()}
        if statuses is not None and not states.get("STOPPING", 0) and states.get("RUNNING", 0) == 1:
            return statuses
        assert time.monotonic() < deadline, f"no scale-down within {timeout_s:.0f} s: {states}"
        time.sleep(0.2)


class TestAutoscaling:
    def test_one_to_two_replicas_under_load_and_back(self, cluster):
        from ray import serve

        scaling = Autoscaling(min_replicas=1, max_replicas=2, target_ongoing_requests=1, upscale_delay_s=0,
                              downscale_delay_s=5, metrics_interval_s=0.5, look_back_period_s=2)
        opts = dataclasses.replace(options("tiny-flux"), autoscaling=scaling)
        print(f"\nautoscaled tiny-flux ready in {deploy(opts):.1f} s")
        codes: list[int] = []
        stop, load = threading.Event(), 6

        def client_loop(seed: int) -> None:
            with httpx.Client(base_url=cluster, timeout=180) as client:
                while not stop.is_set():
                    r = client.post("/v1/images/generations", json={"prompt": PROMPT, "seed": seed,
                                                                    "size": "128x128", "num_inference_steps": 8})
                    codes.append(r.status_code)

        try:
            assert running_replicas("xstage") == 1
            started = time.monotonic()
            threads = [threading.Thread(target=client_loop, args=(s,), daemon=True) for s in range(load)]
            for t in threads:
                t.start()
            while running_replicas("xstage") < 2:
                assert time.monotonic() - started < 180, "no second replica under load within 180 s"
                time.sleep(0.5)
            up_s = time.monotonic() - started
            time.sleep(3)  # both serve a while
            stop.set()
            for t in threads:
                t.join(timeout=120)
            stopped = time.monotonic()
            while running_replicas("xstage") > 1:
                assert time.monotonic() - stopped < 120, "still two replicas 120 s after the load stopped"
                time.sleep(0.5)
            down_s = time.monotonic() - stopped
            assert codes and set(codes) == {200}, sorted(set(codes))
            print(f"scaled 1 -> 2 in {up_s:.1f} s under {load} concurrent clients, back to 1 in {down_s:.1f} s "
                  f"after the load; {len(codes)} requests, all 200")
        finally:
            serve.delete("xstage")
