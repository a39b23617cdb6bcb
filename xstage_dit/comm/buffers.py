"""Who owns the communication buffers: one `CommBuffers` per parallel handle (DeepEP's ``Buffer`` is the model).

A `CommBuffers` keeps the symmetric buffers, the peer windows over them and the abortable group barriers that
the fused ops use, each allocated once (a collective rendezvous) and reused on every call; ``free()`` closes
the windows (they map the buffers), then drops the buffers and barriers. ``parallelize`` makes one for its
groups and frees it on ``restore()``, so a restored pipeline leaves no communication memory behind.

The ops are handed a process group, not an owner (a group crosses the custom-op boundary by name): they ask
`owner_for(group)`, which is the owner registered last for that group (`CommBuffers.serve`), or else the
process's default owner (bare op calls: tests, benchmarks, calibration), which `free_symmetric_buffers()`
frees. Groups are keyed by their name, never by ``id()`` (an id is reused once a group is gone).

    buffers = CommBuffers()
    release = buffers.serve(group)                     # the ops of `group` now allocate into `buffers`
    buf = symmetric_buffer("out", (4, 8), torch.bfloat16, device, group)   # collective on first call
    release(); buffers.free()                          # every buffer, window and barrier of it gone
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from xstage_dit.comm.barrier import group_barrier
from xstage_dit.comm.distributed import SymmetricBuffer, allocate_symmetric_buffer
from xstage_dit.comm.peer_window import PeerWindow

__all__ = ["CommBuffers", "owner_for", "symmetric_buffer", "peer_window", "free_symmetric_buffers"]


def group_key(group: dist.ProcessGroup | None) -> str:
    """A process group's stable name ("" for None, the default group)."""
    return "" if group is None else group.group_name


class CommBuffers:
    """The symmetric buffers, peer windows and group barriers of one owner, freed together by `free()`.

    Every allocating call is collective on its first call for a key (every rank of the group calls it in the
    same order, as the ops do); later calls are a dictionary lookup. ``describe()``: how many of each it holds.
    """

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._buffers: dict[tuple, SymmetricBuffer] = {}
        self._windows: dict[tuple, tuple[PeerWindow, list]] = {}
        self._barriers: dict[tuple, object | None] = {}
        self._lock = threading.Lock()

    def describe(self) -> dict:
        return {"buffers": len(self._buffers), "windows": len(self._windows),
                "bytes": sum(b.tensor.numel() * b.tensor.element_size() for b in self._buffers.values())}

    def group_barrier(self, group: dist.ProcessGroup | None, device: torch.device):
        """The abortable barrier of `group` on `device` (one per pair, shared by its buffers), or None."""
        key = (group_key(group), str(device))
        if key not in self._barriers:
            self._barriers[key] = group_barrier(group, device)
        return self._barriers[key]

    def symmetric_buffer(self, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                         group: dist.ProcessGroup | None = None) -> SymmetricBuffer:
        """The buffer `name` of `shape`/`dtype` over `group`, allocated on its first call."""
        key = (name, tuple(shape), dtype, str(device), group_key(group))
        buf = self._buffers.get(key)
        if buf is None:
            buf = allocate_symmetric_buffer(shape, dtype, device, group, barrier=self.group_barrier)
            self._buffers[key] = buf
        return buf

    def peer_window(self, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device, group=None,
                    *, segments: int = 1, zero: bool = False) -> tuple[PeerWindow, list]:
        """The window over ``segments`` buffers ``name.j`` of ``shape``/``dtype`` (`comm.peer_window`).

        ``zero``: zero the buffers once at allocation (input buffers whose padding rows must read as 0).
        Returns (window, [SymmetricBuffer per segment]). Raises ``PeerWindowUnavailable`` (after allocating the
        buffers, which the pointer-table path then uses) where the window cannot be built.
        """
        key = (name, tuple(shape), dtype, str(device), group_key(group), segments)
        hit = self._windows.get(key)
        if hit is not None and not hit[0].closed:
            return hit
        buffers = [self.symmetric_buffer(f"{name}.{j}", shape, dtype, device, group) for j in range(segments)]
        if zero:
            for b in buffers:
                b.tensor.zero_()
            torch.cuda.synchronize(device)
            for b in buffers:
                b.barrier()
        window = PeerWindow.over_symmetric(buffers)
        self._windows[key] = (window, buffers)
        return window, buffers

    def serve(self, *groups: dist.ProcessGroup | None) -> Callable[[], None]:
        """Make this the owner `owner_for` returns for each of `groups` (None: the default group) until the
        returned release runs (idempotent). The owner registered last for a group serves it."""
        keys = [group_key(g) for g in groups]
        with _REGISTRY_LOCK:
            for key in keys:
                _OWNERS.setdefault(key, []).append(self)

        def release() -> None:
            with _REGISTRY_LOCK:
                for key in keys:
                    owners = _OWNERS.get(key, [])
                    if self in owners:
                        owners.remove(self)
                    if not owners:
                        _OWNERS.pop(key, None)
            keys.clear()

        return release

    def free(self) -> None:
        """Close the windows (they map the buffers), then drop the buffers and the barriers (idempotent).
        Views taken from a window are invalid afterwards; the next call of an op allocates again."""
        with self._lock:
            for window, _ in self._windows.values():
                window.close()
            self._windows.clear()
            self._buffers.clear()
            self._barriers.clear()


_REGISTRY_LOCK = threading.Lock()
_OWNERS: dict[str, list[CommBuffers]] = {}  # group name -> owners serving it, the last one answers
_DEFAULT = CommBuffers("process default")  # bare op calls (tests, benchmarks, calibration)


def owner_for(group: dist.ProcessGroup | None) -> CommBuffers:
    """The owner whose buffers `group`'s ops use: the one registered last (`CommBuffers.serve`), else the
    process default."""
    owners = _OWNERS.get(group_key(group))
    return owners[-1] if owners else _DEFAULT


def symmetric_buffer(name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                     group: dist.ProcessGroup | None = None) -> SymmetricBuffer:
    """``owner_for(group).symmetric_buffer(...)``: what the ops call (collective on a key's first call)."""
    return owner_for(group).symmetric_buffer(name, shape, dtype, device, group)


def peer_window(name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device, group=None, *,
                segments: int = 1, zero: bool = False) -> tuple[PeerWindow, list]:
    """``owner_for(group).peer_window(...)``: what the ops call."""
    return owner_for(group).peer_window(name, shape, dtype, device, group, segments=segments, zero=zero)


def free_symmetric_buffers() -> None:
    """Free the process default owner's buffers (bare op calls: tests, a benchmark between models). A parallel
    handle's buffers are its own: ``restore()`` frees them."""
    _DEFAULT.free()
