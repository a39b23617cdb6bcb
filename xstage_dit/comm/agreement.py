"""Collective safety: ranks that disagree, or a rank that fails, end with the same error on every rank.

Three tools, each for one way a multi-rank program hangs:

- `check_agreement(facts, group)`: one small all-gather of each rank's facts (configuration, model
  class, weight shapes, an input fingerprint); if any fact differs, every rank raises the same
  `RanksDisagree` naming the fact and each rank's value. Call it before the first collective that
  depends on those facts.
- `fail_together(group)`: a block with no collectives inside (local validation). At its end every rank
  reports ok / its error in one all-gather; if any rank failed, every rank raises the same
  `RankFailed` (the first failing rank's error, its rank named). A rank that raised inside the block
  still takes part in that all-gather, so no rank is left waiting.
- `publish_failure(exc, group)` / `wait(work, group)`: for errors in the middle of a forward, where
  the other ranks may already sit in a collective. The failing rank writes its error to the
  process group's key-value store; `wait` (used instead of ``work.wait()`` by the collectives of
  `xstage_dit.families.sharding`) polls the store while its collective is pending and raises the same
  `RankFailed` as soon as a peer has published one. After such a failure the process group is
  unusable (the abandoned collective never completes): the program should exit, as it would after a
  collective timeout, only at once and with the peer's error.

The store is torch's default one (``torch.distributed.distributed_c10d._get_default_store``, private
torch API, used here only).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import hashlib
import time
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

__all__ = ["RanksDisagree", "RankFailed", "check_agreement", "fail_together", "publish_failure", "wait",
           "fingerprint", "leave_together", "make_failure", "published_failure", "clear_failure_together"]

_KEY = "xstage/failure"
_LEAVE = "xstage/leave"  # leave_together's counters


class RanksDisagree(ValueError):
    """Ranks passed different facts (raised with the same message on every rank)."""


class RankFailed(RuntimeError):
    """A rank failed; raised with the same message on every rank of the group.

    When the first failure was a builtin exception (ValueError, NotImplementedError...), every rank raises
    a subclass of both RankFailed and that type, so ``except ValueError`` behaves as at world 1.
    """


@functools.cache
def _failure_type(name: str) -> type:
    builtin = getattr(builtins, name, None)
    if not (isinstance(builtin, type) and issubclass(builtin, Exception)) or issubclass(builtin, RankFailed):
        return RankFailed
    if issubclass(RankFailed, builtin):
        return RankFailed  # RuntimeError, Exception
    return type(f"RankFailed{name}", (RankFailed, builtin), {"__module__": __name__})


def make_failure(kind: str, message: str) -> RankFailed:
    """The `RankFailed` every rank raises for a first failure of builtin type name `kind` (see `RankFailed`)."""
    return _failure_type(kind)(message)


_failure = make_failure


def _world(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def check_agreement(facts: dict[str, Any], group=None, *, what: str = "parallelize") -> None:
    """Raise `RanksDisagree` on every rank if any value of `facts` differs between the ranks of `group`.

    facts: name -> a picklable value with ``==`` (ints, strings, tuples of shapes, fingerprints). One
    ``all_gather_object``; nothing at world 1. Example::

        check_agreement({"config": config, "model": type(model).__qualname__}, group)
    """
    rank, world = _world(group)
    if world == 1:
        return
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, dict(facts), group=group)
    names = list(facts)
    for other in gathered:
        names += [n for n in other if n not in names]
    for name in names:
        values = [g.get(name, "<missing>") for g in gathered]
        if any(v != values[0] for v in values[1:]):
            shown = ", ".join(f"rank {r}: {_short(v)}" for r, v in enumerate(values))
            raise RanksDisagree(f"{what}: expected every rank to pass the same {name}, got {shown}")


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def fail_together(group=None, *, what: str = "parallelize") -> Iterator[None]:
    """Run a block of local work (no collectives inside); any rank's error becomes every rank's error.

    Every rank ends the block with one ``all_gather_object`` of its status. Raises `RankFailed`
    (chained from the local exception on the rank that failed) naming the first failing rank and its
    error; nothing is exchanged at world 1, where the local exception propagates unchanged.
    """
    rank, world = _world(group)
    if world == 1:
        yield
        return
    error: BaseException | None = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - reported to the peers, then raised again below
        error = exc
    statuses: list[Any] = [None] * world
    mine = None if error is None else (type(error).__name__, str(error))
    dist.all_gather_object(statuses, mine, group=group)
    failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if failed:
        first, (kind, message) = failed[0]
        raise _failure(kind, f"{what} failed on rank {first} of {world}: {kind}: {message}") from error


def _store():
    store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if store is None:  # pragma: no cover - present in every torch this project supports
        raise RuntimeError("expected torch.distributed's default store (_get_default_store), got none")
    return store()


def leave_together(timeout_s: float = 30.0, *, poll_s: float = 0.01) -> bool:
    """Wait, on the default store only, until every rank of the world is leaving; True when all arrived within
    `timeout_s`. The store works when the process group does not (after a failed collective), which is why a
    failing rank can leave this way too.

    Two counters: every rank arrives, then waits for all arrivals and departs; rank 0, which hosts the store
    under our launcher, also waits until everyone has departed, so no peer is still reading when its process
    takes the store down (seen as a peer aborting at exit, or failing with a reset socket)."""
    if not dist.is_initialized():
        return True
    store, world = _store(), dist.get_world_size()
    deadline = time.monotonic() + timeout_s

    def wait_for(key: str) -> bool:
        while store.add(key, 0) < world:
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
        return True

    store.add(_LEAVE + "/arrived", 1)
    arrived = wait_for(_LEAVE + "/arrived")
    store.add(_LEAVE + "/departed", 1)
    if dist.get_rank() == 0:
        return wait_for(_LEAVE + "/departed") and arrived
    return arrived


def publish_failure(exc: BaseException, group=None, *, what: str = "forward") -> RankFailed:
    """Record this rank's error for the peers (out of band) and return the `RankFailed` every rank raises:
    the first published one (when several ranks fail at once, all of them raise the first one's error)."""
    rank, world = _world(group)
    global_rank = dist.get_rank() if dist.is_initialized() else 0
    kind = type(exc).__name__
    message = f"{what} failed on rank {global_rank}: {kind}: {exc}"
    if world == 1:
        return _failure(kind, message)
    store = _store()
    # add() is atomic: only the first failing rank writes; get() waits until that message is there.
    if store.add(_KEY + "/count", 1) == 1:
        store.set(_KEY, f"{kind}\n{message}")
    else:
        # Another rank won the add() but may not have set() its message yet: wait for it, or this rank
        # would read no failure and raise None (seen in CI as "exceptions must derive from BaseException").
        store.wait([_KEY])
    return published_failure()


def published_failure() -> RankFailed | None:
    """The failure a rank published, or None (one store round trip)."""
    if not dist.is_initialized():
        return None
    store = _store()
    if not store.check([_KEY]):
        return None
    kind, _, message = store.get(_KEY).decode().partition("\n")
    return _failure(kind, message)


def clear_failure_together(generation: int, timeout_s: float = 60.0, *, poll_s: float = 0.01) -> None:
    """Every rank of the world, after a published failure: wait (on the store alone, which works when the process
    group does not) until all have arrived, then rank 0 removes the failure and every rank goes on once it is gone.
    `generation`: how many recoveries this process made before (the same on every rank: they fail together), so
    each uses its own keys. TimeoutError when a rank does not arrive within `timeout_s`.

    Only the store is cleared: a process group with an abandoned collective stays unusable, so the caller builds
    new groups after this (`server.recovery`)."""
    if not dist.is_initialized():
        return
    store, world = _store(), dist.get_world_size()
    arrived, cleared = f"xstage/recover/{generation}/arrived", f"xstage/recover/{generation}/cleared"
    deadline = time.monotonic() + timeout_s
    store.add(arrived, 1)
    while store.add(arrived, 0) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"expected all {world} ranks to recover from the failure within {timeout_s:g} s, got "
                               f"{store.add(arrived, 0)}")
        time.sleep(poll_s)
    if dist.get_rank() == 0:
        for key in (_KEY, _KEY + "/count"):
            if store.check([key]):
                store.delete_key(key)
        store.set(cleared, "1")
    else:
        store.wait([cleared], timedelta(seconds=timeout_s))


def wait(work, group=None, *, poll_s: float = 0.002) -> None:
    """``work.wait()`` that gives up with the peer's `RankFailed` as soon as a peer has published one.

    work: the handle of a collective issued with ``async_op=True``. A completed collective costs no
    store round trip; a pending one polls the store every `poll_s` seconds.
    """
    if work.is_completed():
        work.wait()
        return
    while not work.is_completed():
        failure = published_failure()
        if failure is not None:
            raise failure
        time.sleep(poll_s)
    work.wait()


def fingerprint(named: dict[str, Any]) -> dict[str, Any]:
    """A cheap summary of named tensors to compare across ranks: shape, dtype and a short hash of the
    float64 sum and sum of squares of each (equal inputs give equal sums on every rank: same kernels,
    same order). Non-tensor values are kept as they are when small and simple. One host sync per device
    the tensors live on."""
    tensors = {k: v.detach() for k, v in named.items() if isinstance(v, torch.Tensor)}
    stats = []
    for x in tensors.values():
        x = torch.view_as_real(x).double() if x.is_complex() else x.double()
        stats.append(torch.stack([x.sum(), x.square().sum()]) if x.numel() else x.new_zeros(2))
    # Inputs may live on several devices (Helios passes CUDA latents beside CPU frame indices): stats are
    # moved to the host per device, one sync per device in use.
    values: list = [None] * len(stats)
    for device in {s.device for s in stats}:
        where = [i for i, s in enumerate(stats) if s.device == device]
        for i, pair in zip(where, torch.stack([stats[i] for i in where]).cpu().tolist()):
            values[i] = pair
    out: dict[str, Any] = {}
    for (name, x), pair in zip(tensors.items(), values):
        digest = hashlib.sha1(repr(pair).encode()).hexdigest()[:12]
        out[name] = (tuple(x.shape), str(x.dtype).replace("torch.", ""), digest)
    for name, v in named.items():
        if name not in tensors and isinstance(v, (int, float, str, bool, type(None))):
            out[name] = v
    return out
