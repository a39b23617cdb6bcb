"""The peer window (DESIGN §2b): every rank's buffers mapped again into ONE address range, at a uniform stride.

Torch symmetric memory (CUDA backend) allocates each buffer with ``cuMemCreate`` and maps every peer's
allocation into this process. A window retains those allocations (``cuMemRetainAllocationHandle``) and maps
them once more, side by side::

    window slot i = segment j of rank o,   i = j * world_size + o,   address = base + i * slot_bytes + offset

``slot_bytes`` is the allocation size rounded up to the mapping granularity (2 MiB). With one segment per
batch element, a (batch * P, rows, heads, head_dim) tensor view with batch stride ``slot_bytes`` addresses
owner o's rows of batch b at slot b*P + o: a kernel with a strided ``out`` then performs the post-attention
All-to-All with its own epilogue (``xstage_dit.ops.attention.window`` has the geometry). Segments are
separate allocations because the driver maps allocations only from offset 0.

Forms:

- ``PeerWindow.over_symmetric(buffers)``: over ``SymmetricBuffer``s of a group (collective allocation, no
  extra rendezvous: torch already mapped every peer). Ranks on separate GPUs: access is set for this device
  on memory that lives on the peer. Ranks sharing one GPU (``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``,
  gloo for control): the same calls.
- ``PeerWindow.local(num_ranks, num_segments, nbytes, device)``: a window over allocations of this process
  (world size 1, the virtual ranks of tests and benchmarks): no rendezvous.
- ``CommBuffers.peer_window(name, ...)`` (`comm.buffers`): the window an owner keeps over its symmetric buffers,
  per (name, shape, dtype, device, group, segments); nothing allocates or maps on the hot path.

Lifetime: a window holds its buffers and retained allocations; ``close()`` (or the finalizer, or its owner's
``CommBuffers.free()``) synchronizes the device, unmaps, frees the range and releases the handles. Views
returned by ``view()`` do not own memory: they are valid until the window is closed.

Where the backend does not allow it (no libcuda, no VMM, an NVSHMEM or NCCL symmetric-memory backend, a
buffer not at a mappable place) construction raises ``PeerWindowUnavailable`` with the reason; callers fall
back to the pointer-table path and log that once.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch

from xstage_dit._torch_private import TorchPrivateAPIError, storage_from_data_pointer, symmetric_memory
from xstage_dit.comm import _cuda_vmm as vmm

log = logging.getLogger(__name__)


class PeerWindowUnavailable(RuntimeError):
    """The peer window cannot be built here; the message says why (callers use the pointer table)."""


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass
class _Mapping:
    """What teardown must undo (kept apart from the window so the finalizer holds no reference to it)."""

    device: int
    base: int = 0
    total_bytes: int = 0
    mapped: list[tuple[int, int]] = field(default_factory=list)  # (address, bytes) of each cuMemMap
    handles: list[int] = field(default_factory=list)  # retained or created allocations to release
    closed: bool = False

    def teardown(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            # No kernel may still write through the window when it goes.
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - interpreter shutdown: the driver frees it all anyway
            log.debug("peer window teardown without synchronize: %s", exc)
        errors = []
        for ptr, nbytes in self.mapped:
            try:
                vmm.unmap(ptr, nbytes)
            except vmm.CudaDriverError as exc:
                errors.append(str(exc))
        if self.base:
            try:
                vmm.address_free(self.base, self.total_bytes)
            except vmm.CudaDriverError as exc:
                errors.append(str(exc))
        for handle in self.handles:
            try:
                vmm.release(handle)
            except vmm.CudaDriverError as exc:
                errors.append(str(exc))
        self.mapped, self.handles, self.base = [], [], 0
        if errors:
            log.warning("peer window teardown: %s", "; ".join(errors))


def _storage_at(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A non-owning uint8 tensor over device memory at ``ptr`` on ``device``.

    Through `_torch_private.storage_from_data_pointer` (the storage inductor's CUDA-graph trees build). The
    public route (``__cuda_array_interface__``) asks the driver which device owns the first byte, which for a
    window slot mapping a peer GPU's memory is the peer, not this device.
    """
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        storage = storage_from_data_pointer(ptr, device, nbytes)
    except TorchPrivateAPIError as exc:
        raise PeerWindowUnavailable(f"window views need it: {exc}") from exc
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))


class PeerWindow:
    """Slots ``segment * num_ranks + owner`` at a uniform ``slot_bytes`` stride from ``base``.

    Attributes: ``base`` (device address), ``slot_bytes``, ``offset`` (bytes from a slot's start to the
    buffer's start, the same in every slot), ``num_ranks``, ``num_segments``, ``device``.
    """

    def __init__(self, slot_ptrs: Sequence, num_ranks: int, num_segments: int, device: torch.device, *,
                 created: bool, keep: object = None, odd_stride: bool = False):
        """Map one allocation per slot, in slot order: buffer addresses to retain, or with ``created`` the
        (handle, bytes, 0) triples of allocations this window made itself (``local``)."""
        if len(slot_ptrs) != num_ranks * num_segments or not slot_ptrs:
            raise ValueError(f"expected {num_ranks} * {num_segments} slots, got {len(slot_ptrs)}")
        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.num_ranks, self.num_segments, self.device = num_ranks, num_segments, device
        self._keep = keep  # the buffers whose memory this window maps: they outlive it
        dev = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self._state = _Mapping(device=dev)
        self._finalizer = weakref.finalize(self, _Mapping.teardown, self._state)
        try:
            self._build(slot_ptrs, created, dev, odd_stride)
        except Exception:
            self.close()
            raise

    def _build(self, slot_ptrs: Sequence[int], created: bool, dev: int, odd_stride: bool) -> None:
        gran = vmm.granularity(dev)
        pieces = []  # (handle, alloc_bytes, offset)
        if created:
            pieces = list(slot_ptrs)
            self._state.handles.extend(h for h, _, _ in pieces)
        else:
            for ptr in slot_ptrs:
                base, size = vmm.address_range(ptr)
                handle = vmm.retain(ptr)
                self._state.handles.append(handle)
                pieces.append((handle, size, ptr - base))
        offsets = {off for _, _, off in pieces}
        if len(offsets) != 1:
            raise PeerWindowUnavailable(f"expected every buffer at one offset inside its allocation, got {offsets}")
        self.offset = offsets.pop()
        if any(size % gran for _, size, _ in pieces):
            raise PeerWindowUnavailable(f"expected allocations in multiples of the {gran}-byte granularity, got "
                                        f"{sorted({size for _, size, _ in pieces})}")
        self.slot_bytes = _round_up(max(size for _, size, _ in pieces), gran)
        if odd_stride and (self.slot_bytes // gran) % 2 == 0:
            # An odd number of granules between slots: the owners' tiles at equal offsets stop aliasing onto
            # the same memory channels (a hypothesis for the all-heads P=8 slowdown; the gap is unbacked VA).
            self.slot_bytes += gran
        self._state.total_bytes = self.slot_bytes * len(pieces)
        self._state.base = vmm.reserve(self._state.total_bytes, gran)
        self.base = self._state.base
        for i, (handle, size, _) in enumerate(pieces):
            addr = self.base + i * self.slot_bytes
            vmm.map_(addr, size, handle)
            self._state.mapped.append((addr, size))
            # This device reads and writes every slot, wherever the memory lives (a peer GPU over NVLink).
            vmm.set_access(addr, size, dev)
        log.debug("peer window: %d slots of %d bytes at %#x on device %d", len(pieces), self.slot_bytes, self.base, dev)

    # ------------------------------------------------------------------------------------------ forms

    @classmethod
    def over_symmetric(cls, buffers: Sequence[object], *, odd_stride: bool = False) -> PeerWindow:
        """Window over ``SymmetricBuffer``s (one per segment) of one group, slot ``j * P + o``."""
        if not buffers:
            raise ValueError("expected at least one symmetric buffer, got none")
        world = {b.world_size for b in buffers}
        if len(world) != 1:
            raise ValueError(f"expected buffers of one group, got world sizes {sorted(world)}")
        num_ranks = world.pop()
        device = buffers[0].tensor.device
        _check_backend(device, any(b.handle is not None for b in buffers))
        if any(b.handle is None for b in buffers):
            raise PeerWindowUnavailable("expected symmetric-memory buffers of a group; world-size-1 buffers are plain "
                                        "allocations (use PeerWindow.local)")
        ptrs = [int(p) for b in buffers for p in b.handle.buffer_ptrs]
        return _guarded(lambda: cls(ptrs, num_ranks, len(buffers), device, created=False, keep=list(buffers),
                                    odd_stride=odd_stride))

    @classmethod
    def local(cls, num_ranks: int, num_segments: int, nbytes: int, device: torch.device, *,
              odd_stride: bool = False) -> PeerWindow:
        """Window over ``num_ranks * num_segments`` fresh allocations of at least ``nbytes`` on ``device``
        (uninitialized), no rendezvous: world size 1 and the virtual ranks of one process."""
        device = torch.device(device)
        _check_backend(device, False)

        def build():
            dev = device.index if device.index is not None else torch.cuda.current_device()
            size = _round_up(max(nbytes, 1), vmm.granularity(dev))
            handles = []
            try:
                for _ in range(num_ranks * num_segments):
                    handles.append(vmm.create(size, dev))
            except Exception:
                for h in handles:
                    vmm.release(h)
                raise
            return cls([(h, size, 0) for h in handles], num_ranks, num_segments, device, created=True,
                       odd_stride=odd_stride)

        return _guarded(build)

    # ------------------------------------------------------------------------------------------ views

    def slot_ptr(self, segment: int, owner: int) -> int:
        """Device address of (segment, owner)'s buffer inside the window."""
        if not (0 <= segment < self.num_segments and 0 <= owner < self.num_ranks):
            raise IndexError(f"expected segment < {self.num_segments} and owner < {self.num_ranks}, "
                             f"got ({segment}, {owner})")
        return self.base + (segment * self.num_ranks + owner) * self.slot_bytes + self.offset

    def view(self, dtype: torch.dtype, shape: Sequence[int], strides: Sequence[int], offset_elems: int = 0
             ) -> torch.Tensor:
        """A strided ``dtype`` view starting ``offset_elems`` elements past slot 0's buffer.

        Example: the owner-as-batch output view of rank r (``window.out_view_spec``), (B*P, L, Hr, D) with
        strides (slot_bytes / elem, H*D, D, 1) and offset h0*D.
        """
        self._check_open()
        elem = torch.empty(0, dtype=dtype).element_size()
        if self.slot_bytes % elem or self.offset % elem:
            raise ValueError(f"expected the slot stride and offset to be multiples of {elem} bytes")
        start = self.offset // elem + offset_elems
        last = start + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else start
        limit = (self._state.total_bytes) // elem
        if start < 0 or last >= limit:
            raise ValueError(f"expected a view inside the window ({limit} elements), got elements {start}..{last}")
        flat = _storage_at(self.base, self._state.total_bytes, self.device).view(dtype)
        return flat.as_strided(tuple(shape), tuple(strides), start)

    def slot_tensor(self, segment: int, owner: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """(segment, owner)'s buffer as a contiguous ``shape`` tensor (the local form's owner buffers)."""
        numel = 1
        for n in shape:
            numel *= n
        elem = torch.empty(0, dtype=dtype).element_size()
        if numel * elem > self.slot_bytes - self.offset:
            raise ValueError(f"expected at most {self.slot_bytes - self.offset} bytes per slot, got {numel * elem}")
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        base_elems = (self.slot_ptr(segment, owner) - self.base - self.offset) // elem
        return self.view(dtype, shape, tuple(reversed(strides)), base_elems)

    def owner_table(self, segment: int = 0) -> torch.Tensor:
        """int64[num_ranks] on the device: segment ``segment``'s slot address of every owner (the Triton
        pointer-table kernel through the window; batch b is ``b * num_ranks * slot_bytes`` further)."""
        return torch.tensor([self.slot_ptr(segment, o) for o in range(self.num_ranks)], dtype=torch.int64,
                            device=self.device)

    @property
    def closed(self) -> bool:
        return self._state.closed

    def _check_open(self) -> None:
        if self._state.closed:
            raise RuntimeError("expected an open peer window, got a closed one")

    def close(self) -> None:
        """Unmap and release (idempotent). Views taken from the window are invalid afterwards."""
        self._finalizer()
        self._keep = None


def _check_backend(device: torch.device, symmetric: bool) -> None:
    if device.type != "cuda":
        raise PeerWindowUnavailable(f"expected a CUDA device for a peer window, got {device}")
    try:
        torch.cuda.synchronize(device)  # a current context on this thread for the driver calls
        dev = device.index if device.index is not None else torch.cuda.current_device()
        if not vmm.vmm_supported(dev):
            raise PeerWindowUnavailable(f"expected a GPU with virtual memory management, got device {dev} without")
    except vmm.CudaDriverError as exc:
        raise PeerWindowUnavailable(str(exc)) from exc
    if symmetric:
        get_backend = getattr(symmetric_memory(), "get_backend", None)
        backend = get_backend(device) if get_backend is not None else "CUDA"
        if str(backend).upper() != "CUDA":
            raise PeerWindowUnavailable(f"expected torch symmetric memory's CUDA backend (cuMemCreate allocations) "
                                        f"for a peer window, got backend {backend!r}")


def _guarded(build):
    """Driver failures become PeerWindowUnavailable (the caller's cue to use the pointer table)."""
    try:
        return build()
    except vmm.CudaDriverError as exc:
        raise PeerWindowUnavailable(f"peer window not available: {exc}") from exc
