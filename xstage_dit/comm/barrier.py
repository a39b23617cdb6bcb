"""An abortable device barrier between the ranks of a group: no GPU stream stays stuck when a peer fails (issue 18).

torch's ``_SymmetricMemory.barrier()`` spins in a kernel until every peer arrives; a peer that raised on the
host never arrives, and its ``timeout_ms`` ends in ``__trap()`` (the context is dead). `GroupBarrier` is
the barrier every fused path uses through ``SymmetricBuffer.barrier()``; it completes at once, on every
rank, when the program has failed (`xstage_dit.comm.watchdog` sets a host-mapped abort word).

Design (chosen over CUDA stream memory operations):

- One tiny kernel (``comm._cuda_barrier``, PTX loaded by the driver): each rank writes epoch ``e`` into its
  slot of every peer's ``int32[world]`` slot array (torch symmetric memory, one per group) with a
  system-scope release store, then spins with acquire loads on its own slots until every peer reached
  ``e`` (cyclic 32-bit comparison: wrap-around is harmless), reading the abort word every 256 polls.
- Why not ``cuStreamWaitValue32`` on the slots (no SM held while waiting)? Its abort must be a *GPU*
  write from another stream; streams share hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``, 1 under
  Megatron-style settings), so the releasing write can queue behind the very wait it must release. And
  its epoch values are frozen into a captured CUDA graph: replays would pass every wait without waiting.
  The kernel keeps its epoch on the device (graph replays stay correct) and is released by a CPU store
  into pinned memory: the watchdog makes no CUDA call at all. It holds one CTA of 32 threads while it
  waits, as torch's barrier does.
- Epochs: one counter per group on the device, shared by every buffer of the group (all ranks issue a
  group's barriers in the same order on one stream, as with torch's barrier); new buffers of the same
  name reuse the group's barrier; two groups (or two processes sharing one GPU) have separate slots.
- The host-mapped ``state = (entered, done)`` epochs let the watchdog see a wait without progress (a dead
  peer) and raise after ``XSTAGE_BARRIER_TIMEOUT_S``.

Host cost of a call: the failure check and the call of the prepared launch (printed by
``tests/comm/test_barrier.py``, the launch replaced by a no-op); the real launch adds one ctypes call and the
raw-stream lookup, then ``cuLaunchKernel``'s own cost, of the order of torch's ``handle.barrier()``, which is a
kernel launch too (the figures: benchmarks/results/figures-from-code.md). Nothing is allocated per call (checked
there).

Fallback: torch's barrier where this one cannot run on some rank (no libcuda entry points, a PTX load
failure): decided on every rank together at creation (one ``all_gather_object``) and logged once.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist

from xstage_dit._torch_private import raw_stream_getter, symmetric_memory
from xstage_dit.comm import _cuda_barrier as cu
from xstage_dit.comm import watchdog

log = logging.getLogger(__name__)


class GroupBarrier:
    """The abortable barrier of one process group on this rank's device.

    Call it to enqueue a barrier on the current stream. ``state()`` -> (entered, done) epochs (host reads of
    mapped memory), ``abort()`` releases every pending and future wait (a CPU store; any thread).
    """

    def __init__(self, launch, stream, abort_words, state_words, rank: int, ranks: list[int], keep=()) -> None:
        self._launch = launch
        self._stream = stream
        self._abort = abort_words
        self._state = state_words
        self.rank = rank
        self.ranks = list(ranks)
        self._keep = keep  # the slot buffer, its handle, the table and the epoch counter the kernel uses

    def __call__(self) -> None:
        watchdog.raise_if_failed()
        self._launch(self._stream())

    def state(self) -> tuple[int, int]:
        return self._state[0], self._state[1]

    def abort(self) -> None:
        self._abort[0] = 1

    def describe(self) -> str:
        return f"the process group of ranks {self.ranks} (this is its rank {self.rank})"


@functools.cache
def _abort_words() -> cu.HostWords:
    return cu.HostWords(1)


def _stream_getter(device_index: int):
    """The current raw stream of the device (an int, no object: `_torch_private.raw_stream_getter`)."""
    return raw_stream_getter(device_index)


_LOGGED: set[str] = set()


def group_barrier(group: dist.ProcessGroup | None, device: torch.device) -> GroupBarrier | None:
    """A new abortable barrier of `group` on `device`, or None where torch's barrier must run instead.

    Collective (every rank calls it, e.g. through ``CommBuffers.symmetric_buffer``): one
    ``all_gather_object`` to agree that every rank can run it, then a rendezvous of the slot buffer. The
    owner of the group's buffers (`comm.buffers.CommBuffers`) makes one per (group, device) and drops it
    with them; the watchdog holds barriers weakly.
    """
    pg = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    index = device.index if device.index is not None else torch.cuda.current_device()
    reason, func = None, None
    try:
        with torch.cuda.device(index):
            func = cu.kernel_for_device(index)
            state = cu.HostWords(2)
            abort = _abort_words()
    except cu.CudaDriverError as exc:
        reason = str(exc)
    reasons: list = [None] * world
    dist.all_gather_object(reasons, reason, group=pg)
    refused = [(r, x) for r, x in enumerate(reasons) if x]
    if refused:
        text = "; ".join(f"rank {r}: {x}" for r, x in refused)
        if text not in _LOGGED:
            _LOGGED.add(text)
            log.warning("abortable device barrier unavailable (%s): using torch's symmetric-memory barrier, "
                        "which a failing peer leaves spinning", text)
        return None
    symm_mem = symmetric_memory()
    slots = symm_mem.empty((world,), dtype=torch.int32, device=device)
    handle = symm_mem.rendezvous(slots, pg)
    slots.zero_()
    table = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
    epoch = torch.zeros(1, dtype=torch.int32, device=device)
    # No peer's first arrival may land in my slots before my zeros (stream order, then torch's barrier).
    handle.barrier()
    launch = cu.Launch(func, table.data_ptr(), epoch.data_ptr(), abort.device, state.device, rank, world)
    barrier = GroupBarrier(launch, _stream_getter(index), abort.words, state.words, rank,
                           dist.get_process_group_ranks(pg), keep=(slots, handle, table, epoch, state))
    dog = watchdog.process_watchdog()
    dog.watch(barrier)
    return barrier
