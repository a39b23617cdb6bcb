"""The CUDA driver's virtual-memory calls (cuMem*) through ctypes on libcuda, for the peer window.

Only what ``peer_window.py`` needs: reserve an address range, map physical allocations into it, give
this device access, and undo all of it. ctypes keeps the package free of a binary dependency (the
device image has ``cuda.bindings`` but CI machines have no libcuda at all); every call's ``CUresult``
is checked and turned into ``CudaDriverError`` with the driver's own message.

Struct layouts are those of ``cuda.h`` (CUDA 12 and 13 agree): ``CUmemLocation``, ``CUmemAllocationProp``,
``CUmemAccessDesc``.
"""

from __future__ import annotations

import ctypes
import functools

CUdeviceptr = ctypes.c_uint64
CUmemGenericAllocationHandle = ctypes.c_uint64

CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_HANDLE_TYPE_NONE = 0x0
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed (or libcuda is missing)."""


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", CUmemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


@functools.cache
def _lib() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaDriverError(f"expected the CUDA driver library libcuda.so.1, got {exc}") from exc
    sigs = {
        "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        "cuCtxGetCurrent": [ctypes.POINTER(ctypes.c_void_p)],
        "cuCtxGetDevice": [ctypes.POINTER(ctypes.c_int)],
        "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
        "cuMemGetAllocationGranularity": [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(CUmemAllocationProp),
                                          ctypes.c_int],
        "cuMemAddressReserve": [ctypes.POINTER(CUdeviceptr), ctypes.c_size_t, ctypes.c_size_t, CUdeviceptr,
                                ctypes.c_ulonglong],
        "cuMemAddressFree": [CUdeviceptr, ctypes.c_size_t],
        "cuMemCreate": [ctypes.POINTER(CUmemGenericAllocationHandle), ctypes.c_size_t,
                        ctypes.POINTER(CUmemAllocationProp), ctypes.c_ulonglong],
        "cuMemRelease": [CUmemGenericAllocationHandle],
        "cuMemMap": [CUdeviceptr, ctypes.c_size_t, ctypes.c_size_t, CUmemGenericAllocationHandle, ctypes.c_ulonglong],
        "cuMemUnmap": [CUdeviceptr, ctypes.c_size_t],
        "cuMemSetAccess": [CUdeviceptr, ctypes.c_size_t, ctypes.POINTER(CUmemAccessDesc), ctypes.c_size_t],
        "cuMemRetainAllocationHandle": [ctypes.POINTER(CUmemGenericAllocationHandle), ctypes.c_void_p],
        "cuMemGetAllocationPropertiesFromHandle": [ctypes.POINTER(CUmemAllocationProp), CUmemGenericAllocationHandle],
        "cuMemGetAddressRange_v2": [ctypes.POINTER(CUdeviceptr), ctypes.POINTER(ctypes.c_size_t), CUdeviceptr],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        _lib().cuGetErrorString(result, ctypes.byref(msg))
        text = msg.value.decode() if msg.value else "unknown error"
        raise CudaDriverError(f"{what} failed: CUresult {result} ({text})")


def current_device() -> int:
    """The device of the calling thread's current context (raises if there is none)."""
    ctx = ctypes.c_void_p()
    _check(_lib().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        raise CudaDriverError("expected a current CUDA context on this thread (initialize torch.cuda first), got none")
    dev = ctypes.c_int()
    _check(_lib().cuCtxGetDevice(ctypes.byref(dev)), "cuCtxGetDevice")
    return dev.value


def vmm_supported(device: int) -> bool:
    val = ctypes.c_int()
    _check(_lib().cuDeviceGetAttribute(ctypes.byref(val), CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                       device), "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)")
    return bool(val.value)


def _device_prop(device: int) -> CUmemAllocationProp:
    prop = CUmemAllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    return prop


def granularity(device: int) -> int:
    """Minimum mapping granularity of device allocations (2 MiB on current GPUs)."""
    size = ctypes.c_size_t()
    prop = _device_prop(device)
    _check(_lib().cuMemGetAllocationGranularity(ctypes.byref(size), ctypes.byref(prop),
                                                CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity")
    return size.value


def create(nbytes: int, device: int) -> int:
    """A physical allocation of ``nbytes`` (a granularity multiple) on ``device``; returns its handle."""
    handle = CUmemGenericAllocationHandle()
    prop = _device_prop(device)
    _check(_lib().cuMemCreate(ctypes.byref(handle), nbytes, ctypes.byref(prop), 0), f"cuMemCreate({nbytes})")
    return handle.value


def release(handle: int) -> None:
    _check(_lib().cuMemRelease(handle), "cuMemRelease")


def reserve(nbytes: int, alignment: int) -> int:
    ptr = CUdeviceptr()
    _check(_lib().cuMemAddressReserve(ctypes.byref(ptr), nbytes, alignment, 0, 0), f"cuMemAddressReserve({nbytes})")
    return ptr.value


def address_free(ptr: int, nbytes: int) -> None:
    _check(_lib().cuMemAddressFree(ptr, nbytes), "cuMemAddressFree")


def map_(ptr: int, nbytes: int, handle: int) -> None:
    # The driver requires offset 0 into the allocation: a window maps whole allocations.
    _check(_lib().cuMemMap(ptr, nbytes, 0, handle, 0), f"cuMemMap({nbytes} bytes at {ptr:#x})")


def unmap(ptr: int, nbytes: int) -> None:
    _check(_lib().cuMemUnmap(ptr, nbytes), "cuMemUnmap")


def set_access(ptr: int, nbytes: int, device: int) -> None:
    desc = CUmemAccessDesc()
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    _check(_lib().cuMemSetAccess(ptr, nbytes, ctypes.byref(desc), 1), f"cuMemSetAccess(device {device})")


def retain(ptr: int) -> int:
    """A new reference to the physical allocation mapped at ``ptr`` (any address inside the mapping)."""
    handle = CUmemGenericAllocationHandle()
    _check(_lib().cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)),
           f"cuMemRetainAllocationHandle({ptr:#x})")
    return handle.value


def allocation_device(handle: int) -> int:
    """The device whose memory backs ``handle``."""
    prop = CUmemAllocationProp()
    _check(_lib().cuMemGetAllocationPropertiesFromHandle(ctypes.byref(prop), handle),
           "cuMemGetAllocationPropertiesFromHandle")
    if prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE:
        raise CudaDriverError(f"expected device memory behind the allocation, got location type {prop.location.type}")
    return prop.location.id


def address_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the mapping that contains ``ptr``."""
    base, size = CUdeviceptr(), ctypes.c_size_t()
    _check(_lib().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr),
           f"cuMemGetAddressRange({ptr:#x})")
    return base.value, size.value
