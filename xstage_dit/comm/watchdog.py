"""The per-process watchdog that releases this rank's device barriers when the program has failed (issue 18).

A rank that raises in the middle of a fused forward publishes its error (``agreement.publish_failure``);
its peers' GPUs may already sit in a device barrier (``comm.barrier``) waiting for it. One daemon thread a
process, started with the first abortable barrier, polls every `POLL_S` seconds:

- the store key ``agreement`` writes (one ``check`` round trip a poll): once a failure is published, it
  records the `RankFailed` (the flag the host reads) and only then aborts every barrier of this process
  (a CPU store into host-mapped memory the barrier kernel polls: no CUDA call, so no stream of ours can
  be blocked behind a stuck one, and a graph capture in another thread is never disturbed);
- each barrier's host-mapped (entered, done) epochs: a barrier pending with no progress for longer than
  ``XSTAGE_BARRIER_TIMEOUT_S`` (default `DEFAULT_TIMEOUT_S`; a peer killed without publishing) becomes a
  ``RankFailed`` that is also a ``TimeoutError``, naming the group's ranks and the timeout, published for
  the other peers, and every barrier is aborted. Only a wait with no progress counts: a peer compiling for
  minutes while this rank waits is fine under the default.

The host raises the recorded failure at the next `raise_if_failed` (each barrier call, each transformer
forward's end in ``patches.collective_safety``): an attribute read, no CUDA sync, no store round trip.
After an abort the barriers' outputs are garbage; the program is expected to end with that error.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from typing import Callable

from xstage_dit.comm import agreement
from xstage_dit.comm._cuda_barrier import epoch_reached

log = logging.getLogger(__name__)

ENV_TIMEOUT = "XSTAGE_BARRIER_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
POLL_S = 0.05


def timeout_from_env(env: dict | None = None) -> float:
    """Seconds a barrier may wait without progress (``XSTAGE_BARRIER_TIMEOUT_S``); ValueError naming a bad value."""
    raw = (os.environ if env is None else env).get(ENV_TIMEOUT)
    if raw is None or raw.strip() == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"expected {ENV_TIMEOUT} to be a number of seconds > 0, got {raw!r}")
    return value


class Watchdog:
    """Failure flag and barrier release for one process.

    Watched barriers expose ``state() -> (entered, done)`` (32-bit epochs), ``abort()`` and ``describe()``.
    `probe()` returns a published `RankFailed` or None; `publish(exc)` records a timeout for the peers and
    returns the failure every rank raises. `poll(now)` is one round (the thread calls it every `poll_s`).
    """

    def __init__(self, probe: Callable[[], agreement.RankFailed | None],
                 publish: Callable[[BaseException], agreement.RankFailed], timeout_s: float,
                 poll_s: float = POLL_S, clock: Callable[[], float] = time.monotonic) -> None:
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"expected a barrier timeout of > 0 seconds, got {timeout_s!r}")
        self.failure: agreement.RankFailed | None = None
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._probe, self._publish, self._clock = probe, publish, clock
        self._barriers: weakref.WeakSet = weakref.WeakSet()
        self._seen: dict[int, tuple[tuple[int, int], float]] = {}
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.store_errors = 0

    def watch(self, barrier) -> None:
        """Watch `barrier` (held weakly); an already failed process aborts it at once."""
        with self._lock:
            self._barriers.add(barrier)
        if self.failure is not None:
            barrier.abort()

    def start(self) -> None:
        """Start the polling thread (once)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="xstage-barrier-watchdog", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.poll(self._clock())
            except Exception:  # noqa: BLE001 - the watchdog must outlive any one bad round
                log.exception("barrier watchdog round failed")
            time.sleep(self.poll_s)

    def poll(self, now: float) -> None:
        """One round: timeouts first (local, cannot block), then the store."""
        if self.failure is not None:
            self._abort_all()  # a peer's late write may have followed a wait out: keep releasing
            return
        for barrier in list(self._barriers):
            entered, done = barrier.state()
            key = id(barrier)
            if epoch_reached(done, entered):  # nothing pending: done caught up with entered
                self._seen.pop(key, None)
                continue
            last = self._seen.get(key)
            if last is None or last[0] != (entered, done):
                self._seen[key] = ((entered, done), now)
            elif now - last[1] > self.timeout_s:
                self._timed_out(barrier, entered, now - last[1])
                return
        try:
            failure = self._probe()
        except Exception as exc:  # noqa: BLE001 - a peer hosting the store may be gone: the timeout still guards
            self.store_errors += 1
            if self.store_errors == 1:
                log.warning("barrier watchdog cannot read the store (%s: %s); relying on the %s s timeout",
                            type(exc).__name__, exc, self.timeout_s)
            return
        if failure is not None:
            self.fail(failure)

    def fail(self, failure: agreement.RankFailed) -> None:
        """Record `failure` (the host's flag first), then release every barrier of this process."""
        if self.failure is None:
            self.failure = failure
        self._abort_all()

    def _abort_all(self) -> None:
        for barrier in list(self._barriers):
            barrier.abort()

    def _timed_out(self, barrier, epoch: int, waited_s: float) -> None:
        message = (f"device barrier of {barrier.describe()} waited {waited_s:.1f} s at epoch {epoch} with no "
                   f"progress, more than {ENV_TIMEOUT}={self.timeout_s:g} s: a peer died or hangs without "
                   f"publishing an error")
        local = agreement.make_failure("TimeoutError", message)
        self.fail(local)  # flag and release before any store call, which may block on a dead peer
        try:
            published = self._publish(TimeoutError(message))
        except Exception as exc:  # noqa: BLE001 - the store may have died with the peer
            log.warning("could not publish the barrier timeout to the peers: %s: %s", type(exc).__name__, exc)
            return
        if published is not None:
            self.failure = published  # the first published failure is every rank's error


_WATCHDOG: Watchdog | None = None
_WATCHDOG_LOCK = threading.Lock()


def process_watchdog() -> Watchdog:
    """This process's watchdog over the default store (created and started on first call)."""
    global _WATCHDOG
    with _WATCHDOG_LOCK:
        if _WATCHDOG is None:
            _WATCHDOG = Watchdog(agreement.published_failure,
                                 lambda exc: agreement.publish_failure(exc, None, what="barrier"),
                                 timeout_from_env())
            _WATCHDOG.start()
        return _WATCHDOG


def failure() -> agreement.RankFailed | None:
    """The failure this process's watchdog has seen, or None (no watchdog: nothing seen)."""
    return None if _WATCHDOG is None else _WATCHDOG.failure


def reset() -> None:
    """Forget the failure this process's watchdog has seen (after the ranks cleared it together and rebuilt their
    groups: `agreement.clear_failure_together`); the barriers it aborted belonged to the groups dropped then."""
    if _WATCHDOG is not None:
        with _WATCHDOG._lock:
            _WATCHDOG.failure = None
            _WATCHDOG._seen.clear()


def raise_if_failed() -> None:
    """Raise the `RankFailed` the watchdog has seen (a peer's published error or a barrier timeout).

    An attribute read: no CUDA sync, no store round trip; cheap enough for every barrier and forward."""
    if _WATCHDOG is not None and _WATCHDOG.failure is not None:
        raise _WATCHDOG.failure
