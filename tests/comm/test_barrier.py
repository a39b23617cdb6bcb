"""The abortable device barrier's host side on the CPU: epoch arithmetic against a model of the kernel, the
watchdog (published failure -> flag then abort; timeout validated, raised with the group named), the
collective-safety hook raising the seen failure without a CUDA sync or a store round trip, the PTX
assembling for sm_90. The device behaviour is tests/comm/test_barrier_gpu.py."""

from __future__ import annotations

import shutil
import subprocess
import time
import tracemalloc

import pytest
import torch

from xstage_dit.comm import _cuda_barrier as cu
from xstage_dit.comm import agreement, watchdog
from xstage_dit.comm.barrier import GroupBarrier
from xstage_dit.comm.distributed import SymmetricBuffer

# ----------------------------------------------------------------------------- epochs and slots


class KernelModel:
    """The PTX kernel's steps for `world` ranks in Python (one int32[world] slot array a rank; a device epoch)."""

    def __init__(self, world: int, start: int = 0) -> None:
        self.world = world
        self.slots = [[start] * world for _ in range(world)]
        self.epoch = [start] * world
        self.aborted = [False] * world

    def arrive(self, rank: int) -> int:
        e = cu.next_epoch(self.epoch[rank])
        for peer in range(self.world):
            if peer != rank:
                self.slots[peer][rank] = e
        return e

    def passes(self, rank: int, e: int) -> bool:
        ok = all(cu.epoch_reached(self.slots[rank][p], e) for p in range(self.world) if p != rank)
        if ok or self.aborted[rank]:
            self.epoch[rank] = e
            return True
        return False


@pytest.mark.parametrize("start", [0, 0xFFFFFFF0, 0x7FFFFFF8])
@pytest.mark.parametrize("world", [2, 3, 8])
def test_epochs_order_every_barrier_across_wrap_around(world, start):
    sim = KernelModel(world, start)
    for step in range(40):
        # Ranks arrive one at a time: nobody passes before the last arrives, then everyone does.
        order = [(step + i) % world for i in range(world)]
        arrived = {}
        for n, r in enumerate(order):
            arrived[r] = sim.arrive(r)
            waiting = [w for w in arrived if w != r or n < world - 1]
            if n < world - 1:
                assert not any(sim.passes(w, arrived[w]) for w in waiting), (step, n)
        assert all(sim.passes(r, arrived[r]) for r in range(world))
        assert len(set(sim.epoch)) == 1
    assert sim.epoch[0] == (start + 40) & cu.EPOCH_MASK


def test_a_rank_one_barrier_ahead_does_not_release_a_peer_early():
    sim = KernelModel(2)
    e0 = sim.arrive(0)
    assert not sim.passes(0, e0)
    e1 = sim.arrive(1)
    assert sim.passes(1, e1)
    # rank 1 runs ahead into the next barrier: rank 0 passes the first, not the second.
    e1b = sim.arrive(1)
    assert sim.passes(0, e0) and not sim.passes(1, e1b)


def test_abort_releases_pending_and_later_waits():
    sim = KernelModel(3)
    e = sim.arrive(0)
    assert not sim.passes(0, e)
    sim.aborted[0] = True
    assert sim.passes(0, e) and sim.passes(0, sim.arrive(0))


def test_epoch_comparison_is_cyclic():
    assert cu.next_epoch(cu.EPOCH_MASK) == 0
    assert cu.epoch_reached(0, cu.EPOCH_MASK) and not cu.epoch_reached(cu.EPOCH_MASK, 0)
    assert cu.epoch_reached(5, 5) and not cu.epoch_reached(4, 5) and cu.epoch_reached(6, 5)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not installed (assembles the PTX for sm_90)")
def test_barrier_ptx_assembles_for_sm90(tmp_path):
    src = tmp_path / "barrier.ptx"
    src.write_text(cu.PTX)
    run = subprocess.run(["ptxas", "-arch=sm_90", str(src), "-o", str(tmp_path / "b.cubin")], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr
    assert f".entry {cu.KERNEL_NAME}(" in cu.PTX


# ----------------------------------------------------------------------------- the watchdog


class FakeBarrier:
    def __init__(self, entered=0, done=0):
        self.words = [entered, done]
        self.aborts = 0

    def state(self):
        return self.words[0], self.words[1]

    def abort(self):
        self.aborts += 1

    def describe(self):
        return "the process group of ranks [0, 1] (this is its rank 0)"


def _dog(probe=lambda: None, publish=None, timeout_s=5.0):
    published = []

    def record(exc):
        published.append(exc)
        return agreement.make_failure(type(exc).__name__, f"barrier failed on rank 0: {type(exc).__name__}: {exc}")

    return watchdog.Watchdog(probe, publish or record, timeout_s), published


def test_a_published_failure_sets_the_flag_then_aborts():
    failure = agreement.make_failure("ValueError", "forward failed on rank 1: ValueError: injected")
    answers = [None, None, failure]
    dog, _ = _dog(probe=lambda: answers.pop(0))
    b = FakeBarrier(3, 2)
    order = []
    b.abort = lambda: order.append(("abort", dog.failure is not None))
    dog.watch(b)
    dog.poll(0.0)
    dog.poll(0.05)
    assert dog.failure is None and order == []
    dog.poll(0.1)
    assert dog.failure is failure and order == [("abort", True)]  # flag first, then the release
    dog.poll(0.15)  # keeps releasing (a late peer write can follow a wait out)
    assert len(order) == 2
    late = FakeBarrier()
    late.abort = lambda: order.append(("late", True))
    dog.watch(late)  # a barrier made after the failure is released at once
    assert order[-1] == ("late", True)


def test_a_wait_without_progress_times_out_with_the_group_named():
    dog, published = _dog(timeout_s=5.0)
    b = FakeBarrier(entered=8, done=7)
    dog.watch(b)
    dog.poll(100.0)
    dog.poll(104.9)
    assert dog.failure is None and b.aborts == 0
    dog.poll(105.2)
    assert b.aborts == 1
    err = dog.failure
    assert isinstance(err, agreement.RankFailed) and isinstance(err, TimeoutError)
    text = str(err)
    assert "ranks [0, 1]" in text and "XSTAGE_BARRIER_TIMEOUT_S=5 s" in text and "epoch 8" in text
    assert len(published) == 1 and isinstance(published[0], TimeoutError)


def test_progress_or_an_idle_barrier_never_times_out():
    dog, _ = _dog(timeout_s=1.0)
    b = FakeBarrier(entered=0, done=0)
    dog.watch(b)
    for t in range(10):  # idle: done == entered
        dog.poll(float(t))
    for t in range(10, 40):  # busy but progressing every poll, one barrier behind
        b.words = [t + 1, t]
        dog.poll(float(t))
    b.words = [0x00000001, 0xFFFFFFFF]  # pending across the wrap: counted from now
    dog.poll(50.0)
    dog.poll(50.9)
    assert dog.failure is None
    dog.poll(51.1)
    assert isinstance(dog.failure, TimeoutError)


def test_an_unreachable_store_leaves_the_timeout_in_charge():
    def gone():
        raise ConnectionError("peer hosting the store died")

    def publish(exc):
        raise ConnectionError("no store")

    dog, _ = _dog(probe=gone, publish=publish, timeout_s=2.0)
    b = FakeBarrier(2, 1)
    dog.watch(b)
    dog.poll(0.0)
    assert dog.failure is None and dog.store_errors == 1
    dog.poll(2.5)
    assert isinstance(dog.failure, TimeoutError) and b.aborts == 1  # the local error, unpublished


@pytest.mark.parametrize("raw", ["abc", "0", "-3", "inf", "nan", "1e400"])
def test_timeout_env_is_validated(raw):
    with pytest.raises(ValueError, match=rf"expected XSTAGE_BARRIER_TIMEOUT_S to be a number of seconds > 0, got '{raw}'"):
        watchdog.timeout_from_env({"XSTAGE_BARRIER_TIMEOUT_S": raw})


def test_timeout_env_default_and_value():
    assert watchdog.timeout_from_env({}) == watchdog.DEFAULT_TIMEOUT_S == 600.0
    assert watchdog.timeout_from_env({"XSTAGE_BARRIER_TIMEOUT_S": " 2.5 "}) == 2.5
    with pytest.raises(ValueError, match="got 0"):
        watchdog.Watchdog(lambda: None, lambda e: None, 0)


def test_the_thread_sees_a_published_failure_within_a_few_polls():
    failure = agreement.make_failure("RuntimeError", "forward failed on rank 1: RuntimeError: x")
    box = {"failure": None}
    dog = watchdog.Watchdog(lambda: box["failure"], lambda e: None, 60.0, poll_s=0.01)
    b = FakeBarrier(1, 0)
    dog.watch(b)
    dog.start()
    dog.start()  # once
    box["failure"] = failure
    deadline = time.monotonic() + 5.0
    while b.aborts == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dog.failure is failure and b.aborts >= 1


# ----------------------------------------------------------------------------- the barrier's host path


def test_group_barrier_raises_the_seen_failure_and_allocates_nothing(monkeypatch):
    dog, _ = _dog()
    monkeypatch.setattr(watchdog, "_WATCHDOG", dog)
    launches = []
    stream = 0x1234_5678_9ABC

    abort = [0]
    b = GroupBarrier(launches.append, lambda: stream, abort, [4, 4], 0, [0, 1])
    buf = SymmetricBuffer(torch.zeros(1), torch.zeros(2, dtype=torch.int64), 0, 2, handle=object(), group_barrier=b)
    buf.barrier()
    assert launches == [stream]  # the group's barrier, not the handle's
    launches.clear()
    fast = GroupBarrier(lambda s: None, lambda: stream, abort, [4, 4], 0, [0, 1])
    for _ in range(100):
        fast()
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        fast()
    per_call_us = (time.perf_counter() - t0) / n * 1e6
    print(f"GroupBarrier host cost without the driver call: {per_call_us:.2f} us per call")
    tracemalloc.start()
    snap0 = tracemalloc.take_snapshot()
    for _ in range(n):
        fast()
    snap1 = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = [d for d in snap1.compare_to(snap0, "filename") if d.size_diff > 0
             and str(d.traceback).replace("\\", "/").endswith(("comm/barrier.py", "comm/watchdog.py"))]
    assert not grown, grown  # nothing allocated per call by the barrier or the flag check
    b.abort()
    assert abort == [1]
    dog.fail(agreement.make_failure("ValueError", "forward failed on rank 1: ValueError: injected"))
    with pytest.raises(ValueError, match="injected") as raised:
        buf.barrier()
    assert isinstance(raised.value, agreement.RankFailed) and launches == []  # no launch after the failure


def test_buffers_without_a_group_barrier_keep_torch_barrier_or_nothing():
    calls = []

    class Handle:
        def barrier(self):
            calls.append("torch")

    SymmetricBuffer(torch.zeros(1), torch.zeros(2, dtype=torch.int64), 0, 2, handle=Handle()).barrier()
    SymmetricBuffer(torch.zeros(1), torch.zeros(1, dtype=torch.int64), 0, 1).barrier()  # world 1: no-op
    assert calls == ["torch"]


# ----------------------------------------------------------------------------- the hook


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.during = None

    def forward(self, hidden_states):
        if self.during is not None:
            self.during()
        return self.lin(hidden_states)


def _hooked(check_inputs=False):
    from diffusers.hooks import HookRegistry

    from xstage_dit.features.collective_safety import CollectiveSafetyHook

    model = Tiny()
    HookRegistry.check_if_exists_or_initialize(model).register_hook(
        CollectiveSafetyHook(None, Tiny, check_inputs), "xstage_collective_safety")
    return model


@pytest.fixture
def counted(monkeypatch):
    counts = {"cuda.synchronize": 0, "Tensor.item": 0, "Tensor.tolist": 0, "Tensor.cpu": 0, "store": 0,
              "publish": 0}

    def counting(name, original=None):
        def call(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs) if original else None
        return call

    monkeypatch.setattr(torch.cuda, "synchronize", counting("cuda.synchronize"))
    for name in ("item", "tolist", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, counting(f"Tensor.{name}", getattr(torch.Tensor, name)))
    monkeypatch.setattr(agreement, "_store", counting("store"))
    monkeypatch.setattr(agreement, "publish_failure", counting("publish", agreement.publish_failure))
    return counts


def test_hook_raises_a_failure_seen_during_the_forward_at_its_end(monkeypatch, counted):
    dog, _ = _dog()
    monkeypatch.setattr(watchdog, "_WATCHDOG", dog)
    model = _hooked()
    x = torch.randn(3, 4)
    for _ in range(20):
        model(x)
    # The hot path: no host sync, no store round trip, nothing published.
    assert counted == {k: 0 for k in counted}, counted
    failure = agreement.make_failure("ValueError", "Tiny forward failed on rank 1: ValueError: injected")
    model.during = lambda: dog.fail(failure)  # the watchdog thread sets the flag while this forward runs
    with pytest.raises(ValueError, match="rank 1: ValueError: injected") as raised:
        model(x)
    assert raised.value is failure and counted["publish"] == 0  # the peer's error, not re-published as ours
    model.during = None
    with pytest.raises(agreement.RankFailed):  # and before any later forward (no collective is entered)
        model(x)


def test_hook_checks_the_flag_before_the_input_agreement(monkeypatch):
    dog, _ = _dog()
    monkeypatch.setattr(watchdog, "_WATCHDOG", dog)
    dog.fail(agreement.make_failure("RuntimeError", "forward failed on rank 1: RuntimeError: gone"))
    entered = []
    monkeypatch.setattr(agreement, "check_agreement", lambda *a, **k: entered.append(1))
    with pytest.raises(agreement.RankFailed, match="gone"):
        _hooked(check_inputs=True)(torch.randn(2, 4))
    assert entered == []


def test_no_watchdog_means_no_failure(monkeypatch):
    monkeypatch.setattr(watchdog, "_WATCHDOG", None)
    watchdog.raise_if_failed()
    assert watchdog.failure() is None
