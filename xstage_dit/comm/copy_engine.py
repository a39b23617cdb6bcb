"""Pitched device-to-device copies (``cuMemcpy2DAsync``, the copy engine) through ctypes on libcuda.

The copy engine's way to move one owner's head slice of a rank's (B, L, H, D) tokens into its
(3, B, P*L, Hr_max, D) input buffer.

A copy of ``height`` rows of ``width_bytes`` each, the source rows ``src_pitch`` bytes apart and the
destination rows ``dst_pitch`` apart, on ``stream``; the addresses may be this device's memory or a peer's
mapped into this process (a window slot, a symmetric buffer's peer pointer). No SM runs it where the driver
uses a copy engine for device-to-device copies. ``benchmarks/bench_attention_a2a.py --window --pre-a2a``
compares it with the push kernel and with the library All-to-All's copies.
"""

from __future__ import annotations

import ctypes
import functools

from xstage_dit.comm._cuda_vmm import CUdeviceptr, _check, _lib

CU_MEMORYTYPE_DEVICE = 2

__all__ = ["memcpy_2d_async"]


class CUDA_MEMCPY2D(ctypes.Structure):  # noqa: N801 - the driver's name (cuda.h)
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", CUdeviceptr), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
                ("dstHost", ctypes.c_void_p), ("dstDevice", CUdeviceptr), ("dstArray", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


@functools.cache
def _fn():
    fn = _lib().cuMemcpy2DAsync_v2
    fn.argtypes = [ctypes.POINTER(CUDA_MEMCPY2D), ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def describe_copy(dst: int, dst_pitch: int, src: int, src_pitch: int, width_bytes: int, height: int
                  ) -> CUDA_MEMCPY2D:
    """The driver's descriptor of one pitched device-to-device copy (validated: ValueError naming the value)."""
    for name, value in (("dst", dst), ("src", src), ("width_bytes", width_bytes), ("height", height)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"expected {name} to be a positive int, got {value!r}")
    for name, pitch in (("src_pitch", src_pitch), ("dst_pitch", dst_pitch)):
        if not isinstance(pitch, int) or (height > 1 and pitch < width_bytes):
            raise ValueError(f"expected {name} >= width_bytes = {width_bytes} for {height} rows, got {pitch!r}")
    desc = CUDA_MEMCPY2D()
    desc.srcMemoryType = desc.dstMemoryType = CU_MEMORYTYPE_DEVICE
    desc.srcDevice, desc.srcPitch = src, max(src_pitch, width_bytes)
    desc.dstDevice, desc.dstPitch = dst, max(dst_pitch, width_bytes)
    desc.WidthInBytes, desc.Height = width_bytes, height
    return desc


def memcpy_2d_async(dst: int, dst_pitch: int, src: int, src_pitch: int, width_bytes: int, height: int,
                    stream: int) -> None:
    """Enqueue ``height`` rows of ``width_bytes`` from ``src`` (rows ``src_pitch`` apart) to ``dst`` (rows
    ``dst_pitch`` apart) on the CUDA stream handle ``stream`` (``torch.cuda.current_stream().cuda_stream``).

    Example: owner o's heads [h0, h0+hr) of rank r's (L, H, D) bf16 tokens into rows [r*L, (r+1)*L) of its
    (P*L, Hmax, D) buffer: ``memcpy_2d_async(dst + r*L*Hmax*D*2, Hmax*D*2, src + h0*D*2, H*D*2, hr*D*2, L, s)``.
    """
    desc = describe_copy(dst, dst_pitch, src, src_pitch, width_bytes, height)
    _check(_fn()(ctypes.byref(desc), ctypes.c_void_p(stream)), "cuMemcpy2DAsync")
