"""The abortable barrier's device code (PTX) and the CUDA driver calls that load and launch it (ctypes on libcuda).

Why PTX loaded by the driver: the kernel is 60 instructions, and the driver's own JIT (``cuModuleLoadData``)
compiles it on every machine with no nvcc, NVRTC or torch headers at run time; ``tests/comm/test_barrier.py``
assembles it with ``ptxas`` for sm_90 where ptxas is installed (CI, development machines).

``xstage_barrier(table, epoch, abort, state, rank, world)``, one CTA of 32 threads, thread t serving peers
t, t + 32, ...:

- ``e = *epoch + 1`` (32-bit, wraps); thread 0 writes ``state[0] = e`` (host-mapped: "entered").
- arrive: ``fence.acq_rel.sys``, then ``st.release.sys table[p][rank] = e`` for every peer p
  (my slot in peer p's ``int32[world]`` slot array; the fence orders earlier kernels' remote stores first).
- wait: spin on ``ld.acquire.sys table[rank][p]`` until ``(int32)(slot - e) >= 0`` (cyclic, as
  ``cuStreamWaitValue32``'s GEQ: wrap-around is harmless); every 256 polls read the host-mapped ``abort``
  word and stop waiting when it is non-zero.
- ``bar.sync``; thread 0 stores ``*epoch = e`` and ``state[1] = e`` ("done").

The epoch lives on the device, so a CUDA graph that captured the launch replays it correctly.
"""

from __future__ import annotations

import ctypes
import functools

from xstage_dit.comm._cuda_vmm import CudaDriverError, _check
from xstage_dit.comm._cuda_vmm import _lib as _vmm_lib

KERNEL_NAME = "xstage_barrier"
THREADS = 32
ABORT_POLL_MASK = 255  # read the (PCIe, slow) abort word once every 256 slot polls

PTX = r"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry xstage_barrier(
    .param .u64 p_table,
    .param .u64 p_epoch,
    .param .u64 p_abort,
    .param .u64 p_state,
    .param .u32 p_rank,
    .param .u32 p_world
)
{
    .reg .pred %p<8>;
    .reg .b32 %r<16>;
    .reg .b64 %rd<16>;

    ld.param.u64 %rd1, [p_table];
    ld.param.u64 %rd2, [p_epoch];
    ld.param.u64 %rd3, [p_abort];
    ld.param.u64 %rd4, [p_state];
    ld.param.u32 %r1, [p_rank];
    ld.param.u32 %r2, [p_world];
    mov.u32 %r3, %tid.x;
    mov.u32 %r12, %ntid.x;
    setp.ne.u32 %p1, %r3, 0;

    ld.volatile.u32 %r4, [%rd2];
    add.u32 %r5, %r4, 1;
    @%p1 bra ENTERED;
    st.relaxed.sys.u32 [%rd4], %r5;
ENTERED:
    mul.wide.u32 %rd5, %r1, 8;
    add.u64 %rd6, %rd1, %rd5;
    ld.u64 %rd7, [%rd6];
    mul.wide.u32 %rd8, %r1, 4;
    fence.acq_rel.sys;

    mov.u32 %r6, %r3;
ARRIVE:
    setp.ge.u32 %p2, %r6, %r2;
    @%p2 bra ARRIVED;
    setp.eq.u32 %p3, %r6, %r1;
    @%p3 bra ARRIVE_NEXT;
    mul.wide.u32 %rd9, %r6, 8;
    add.u64 %rd10, %rd1, %rd9;
    ld.u64 %rd11, [%rd10];
    add.u64 %rd12, %rd11, %rd8;
    st.release.sys.u32 [%rd12], %r5;
ARRIVE_NEXT:
    add.u32 %r6, %r6, %r12;
    bra ARRIVE;
ARRIVED:

    mov.u32 %r6, %r3;
WAIT:
    setp.ge.u32 %p2, %r6, %r2;
    @%p2 bra WAITED;
    setp.eq.u32 %p3, %r6, %r1;
    @%p3 bra WAIT_NEXT;
    mul.wide.u32 %rd9, %r6, 4;
    add.u64 %rd13, %rd7, %rd9;
    mov.u32 %r7, 0;
SPIN:
    ld.acquire.sys.u32 %r8, [%rd13];
    sub.u32 %r9, %r8, %r5;
    setp.ge.s32 %p4, %r9, 0;
    @%p4 bra WAIT_NEXT;
    add.u32 %r7, %r7, 1;
    and.b32 %r10, %r7, 255;
    setp.ne.u32 %p5, %r10, 0;
    @%p5 bra SPIN;
    ld.relaxed.sys.u32 %r11, [%rd3];
    setp.ne.u32 %p6, %r11, 0;
    @%p6 bra WAITED;
    bra SPIN;
WAIT_NEXT:
    add.u32 %r6, %r6, %r12;
    bra WAIT;
WAITED:
    bar.sync 0;
    @%p1 bra DONE;
    st.volatile.u32 [%rd2], %r5;
    st.relaxed.sys.u32 [%rd4+4], %r5;
DONE:
    ret;
}
"""

EPOCH_MASK = 0xFFFFFFFF


def next_epoch(epoch: int) -> int:
    """The epoch a barrier after `epoch` waits for (the kernel's 32-bit ``add``: wraps to 0)."""
    return (epoch + 1) & EPOCH_MASK


def epoch_reached(slot: int, epoch: int) -> bool:
    """The kernel's wait condition ``(int32)(slot - epoch) >= 0``: a peer's slot has reached `epoch` (cyclic)."""
    return ((slot - epoch) & EPOCH_MASK) < 0x80000000


CU_MEMHOSTALLOC_PORTABLE = 0x01
CU_MEMHOSTALLOC_DEVICEMAP = 0x02


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = _vmm_lib()
    sigs = {
        "cuModuleLoadData": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p],
        "cuModuleGetFunction": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p],
        "cuMemHostAlloc": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint],
        "cuMemHostGetDevicePointer_v2": [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint],
        "cuLaunchKernel": [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                           ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p,
                           ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    return lib


@functools.cache
def kernel_for_device(device_index: int) -> int:
    """The loaded ``xstage_barrier`` function (CUfunction) in the current context of ``device_index``.

    The caller makes that device's primary context current (``torch.cuda.device(device_index)``); loaded once.
    """
    del device_index  # the cache key: one module per device context
    lib = _lib()
    module, func = ctypes.c_void_p(), ctypes.c_void_p()
    _check(lib.cuModuleLoadData(ctypes.byref(module), PTX.encode() + b"\0"), "cuModuleLoadData(xstage_barrier PTX)")
    _check(lib.cuModuleGetFunction(ctypes.byref(func), module, KERNEL_NAME.encode()),
           f"cuModuleGetFunction({KERNEL_NAME})")
    return func.value


class HostWords:
    """``count`` int32 words of pinned host memory mapped into the device's address space.

    host: the host address (read and written by plain CPU loads/stores, no CUDA call: safe from any thread,
    even while another thread captures a CUDA graph); device: the address kernels use. Never freed: a
    barrier kernel may still read them when Python drops the object (a few bytes for the process' life).
    """

    def __init__(self, count: int) -> None:
        lib = _lib()
        host = ctypes.c_void_p()
        nbytes = 4 * count
        _check(lib.cuMemHostAlloc(ctypes.byref(host), nbytes, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP),
               f"cuMemHostAlloc({nbytes})")
        dev = ctypes.c_uint64()
        _check(lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dev), host, 0), "cuMemHostGetDevicePointer")
        self.host, self.device = host.value, dev.value
        self.words = (ctypes.c_uint32 * count).from_address(self.host)
        for i in range(count):
            self.words[i] = 0


class Launch:
    """One prepared launch of the barrier kernel: the argument block is built once, a call costs one
    ``cuLaunchKernel`` through ctypes (no Python allocation but the stream handle's int)."""

    def __init__(self, func: int, table: int, epoch: int, abort: int, state: int, rank: int, world: int) -> None:
        self._args = (ctypes.c_uint64(table), ctypes.c_uint64(epoch), ctypes.c_uint64(abort), ctypes.c_uint64(state),
                      ctypes.c_uint32(rank), ctypes.c_uint32(world))
        self._params = (ctypes.c_void_p * len(self._args))(*[ctypes.addressof(a) for a in self._args])
        self._func = ctypes.c_void_p(func)
        self._launch = _lib().cuLaunchKernel

    def __call__(self, stream: int) -> None:
        result = self._launch(self._func, 1, 1, 1, THREADS, 1, 1, 0, stream, self._params, None)
        if result:
            _check(result, "cuLaunchKernel(xstage_barrier)")


__all__ = ["CudaDriverError", "HostWords", "Launch", "PTX", "epoch_reached", "kernel_for_device", "next_epoch"]
