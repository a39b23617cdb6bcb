"""ctypes binding of the remote-store burst kernel (``burst.cu``) and its targets.

Three layers (FlashInfer-style): ``burst.cu`` knows nothing of torch; ``BurstLib`` checks arguments
and launches on torch's current stream; ``run_bursts`` returns per-producer timings in seconds.

Targets (``BurstTarget``): ``local_target`` (this GPU's HBM, the control), ``host_target``
(host-pinned memory mapped into the GPU's address space: every store crosses PCIe) and
``peer_target`` (a peer rank's buffer through its mapped address: NVLink between two GPUs).
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from xstage_dit.calibration.csrc.build import build_library

HEADER_WORDS = 6
VEC_BYTES = 16
DEFAULT_THREADS = 512


class BurstError(RuntimeError):
    """A CUDA or argument error reported by the burst launcher."""


class BurstLib:
    """The loaded ``libxstage_burst.so`` with typed entry points."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        c_ll, c_int, c_vp, c_uint = ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint
        lib.xs_burst_launch.argtypes = [c_vp, c_ll, c_ll, c_int, c_int, c_int, c_ll, c_int, c_vp, c_vp, c_vp, c_uint,
                                        c_int, c_vp]
        lib.xs_burst_launch.restype = c_int
        lib.xs_clock_probe.argtypes = [c_vp, c_int, c_ll, c_int, c_vp]
        lib.xs_clock_probe.restype = c_int
        lib.xs_host_alloc.argtypes = [c_ll, c_int, ctypes.POINTER(c_vp), ctypes.POINTER(c_vp)]
        lib.xs_host_alloc.restype = c_int
        lib.xs_host_free.argtypes = [c_vp]
        lib.xs_host_free.restype = c_int
        lib.xs_error_string.argtypes = [c_int]
        lib.xs_error_string.restype = ctypes.c_char_p
        lib.xs_max_bursts.restype = c_int
        lib.xs_burst_sync_words.argtypes = [c_int]
        lib.xs_burst_sync_words.restype = c_int
        self.lib = lib
        self.path = path
        self.max_bursts = int(lib.xs_max_bursts())

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raise BurstError(f"{what} failed: {self.lib.xs_error_string(code).decode()} (code {code})")


@functools.cache
def load_library(compute_capability: tuple[int, int]) -> BurstLib:
    """Build (first use, cached on disk) and load the burst library for this compute capability."""
    return BurstLib(str(build_library("xstage_burst", ["burst.cu"], compute_capability)))


def library_for(device: torch.device) -> BurstLib:
    return load_library(tuple(torch.cuda.get_device_capability(device)))


@dataclass
class BurstTarget:
    """A device-visible destination of ``nbytes`` bytes at address ``dev_ptr``.

    name: "local" | "host" | "nvlink". read_back(): the destination's bytes as a CPU uint8 tensor
    (for checking that the data landed); None where this process cannot read it (a peer's buffer).
    """

    name: str
    dev_ptr: int
    nbytes: int
    device: torch.device
    read_back: Callable[[], torch.Tensor] | None = None
    keepalive: object = None


def local_target(nbytes: int, device: torch.device) -> BurstTarget:
    """``nbytes`` of this GPU's HBM."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return BurstTarget("local", buf.data_ptr(), nbytes, device, lambda: buf.cpu(), buf)


class _HostBuffer:
    def __init__(self, lib: BurstLib, nbytes: int, device: torch.device):
        host, dev = ctypes.c_void_p(), ctypes.c_void_p()
        lib.check(lib.lib.xs_host_alloc(nbytes, device.index or 0, ctypes.byref(host), ctypes.byref(dev)),
                  f"cudaHostAlloc({nbytes} bytes, mapped)")
        self.host_ptr, self.dev_ptr, self.nbytes = host.value, dev.value, nbytes
        self._finalizer = weakref.finalize(self, lib.lib.xs_host_free, ctypes.c_void_p(host.value))

    def tensor(self) -> torch.Tensor:
        array = (ctypes.c_uint8 * self.nbytes).from_address(self.host_ptr)
        return torch.from_numpy(np.frombuffer(array, dtype=np.uint8)).clone()


def host_target(nbytes: int, device: torch.device) -> BurstTarget:
    """``nbytes`` of host-pinned memory mapped into ``device``'s address space (stores cross PCIe)."""
    buf = _HostBuffer(library_for(device), nbytes, device)
    return BurstTarget("host", buf.dev_ptr, nbytes, device, buf.tensor, buf)


def peer_target(peer_ptr: int, nbytes: int, device: torch.device, keepalive: object = None) -> BurstTarget:
    """A peer rank's buffer of ``nbytes`` at its address ``peer_ptr`` as mapped in this process."""
    return BurstTarget("nvlink", int(peer_ptr), nbytes, device, None, keepalive)


@dataclass
class BurstTiming:
    """Timings of one launch, seconds.

    issue_s: (num_producers, num_bursts) issue time of each producer's bursts (start to the moment its
        stores were accepted).
    gap_s, period_s: (num_producers, num_bursts - 1) time from a burst's issue end (start) to the next
        burst's issue start: the measured gap (the work, the loop's own overhead and any stall that lands
        after the issue window) and the period.
    gap_iters: FMA iterations of work per gap. aligned_every_burst: every burst started aligned (a grid
        barrier after the gaps; the wait for the slowest producer is part of the gap), else only the first.
    sm_ids: (num_producers,) SM of each producer. clock_hz: SM clock used to convert cycles.
    """

    bytes_per_producer: int
    num_producers: int
    num_bursts: int
    gap_iters: int
    issue_s: np.ndarray
    gap_s: np.ndarray
    period_s: np.ndarray
    sm_ids: np.ndarray
    clock_hz: float
    kernel_s: float
    aligned_every_burst: bool = False

    @property
    def volume_bytes(self) -> int:
        return self.bytes_per_producer * self.num_producers


def measure_sm_clock_hz(device: torch.device, spin_s: float = 2e-3) -> float:
    """SM clock (Hz) while every SM spins: clock64 cycles over %globaltimer ns, median over SMs."""
    lib = library_for(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    out = torch.empty(2 * sms, dtype=torch.int64, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream
    lib.check(lib.lib.xs_clock_probe(out.data_ptr(), sms, int(spin_s * 1e9), device.index or 0, stream), "clock probe")
    pairs = out.view(sms, 2).cpu().numpy().astype(np.float64)
    return float(np.median(pairs[:, 0] / pairs[:, 1]) * 1e9)


def run_bursts(
    target: BurstTarget,
    *,
    bytes_per_producer: int,
    num_producers: int,
    num_bursts: int,
    gap_iters: int,
    clock_hz: float,
    threads: int = DEFAULT_THREADS,
    tag: int = 0x5EED,
    align_every_burst: bool = False,
) -> BurstTiming:
    """Launch ``num_bursts`` bursts of ``num_producers * bytes_per_producer`` bytes into ``target``, each
    producer doing ``gap_iters`` iterations of arithmetic between its bursts (``GapModel`` converts
    seconds); wait and return the timings. ``clock_hz`` converts cycles where the launch is too short
    to carry its own clock. ``align_every_burst``: start every burst aligned across producers (the
    X-Stage setting, a burst of V at once); else only the first burst is aligned and the producers free-run.

    A launch of one burst is an isolated burst: the previous kernel's stores have drained when it starts.
    """
    device = target.device
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if not 1 <= num_producers <= sms:
        raise ValueError(f"expected 1 <= num_producers <= {sms} (SMs: producers must be co-resident), got {num_producers}")
    if bytes_per_producer <= 0 or bytes_per_producer % VEC_BYTES:
        raise ValueError(f"expected bytes_per_producer a positive multiple of {VEC_BYTES}, got {bytes_per_producer}")
    if num_producers * bytes_per_producer > target.nbytes:
        raise ValueError(f"expected num_producers * bytes_per_producer <= the {target.name} buffer's {target.nbytes} "
                         f"bytes, got {num_producers} * {bytes_per_producer} = {num_producers * bytes_per_producer}")
    lib = library_for(device)
    if not 1 <= num_bursts <= lib.max_bursts:
        raise ValueError(f"expected 1 <= num_bursts <= {lib.max_bursts}, got {num_bursts}")
    if not isinstance(gap_iters, (int, np.integer)) or gap_iters < 0:
        raise ValueError(f"expected gap_iters an int >= 0, got {gap_iters!r}")
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"expected threads a multiple of 32 in [32, 1024], got {threads}")
    row = HEADER_WORDS + 2 * num_bursts
    ts = torch.empty(num_producers, row, dtype=torch.int64, device=device)
    sync = torch.empty(max(2, int(lib.lib.xs_burst_sync_words(num_bursts))), dtype=torch.int64, device=device)
    sink = torch.empty(num_producers * threads, dtype=torch.float32, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream
    code = lib.lib.xs_burst_launch(
        target.dev_ptr, target.nbytes, bytes_per_producer, num_producers, threads, num_bursts,
        int(gap_iters), int(bool(align_every_burst)), ts.data_ptr(), sync.data_ptr(), sink.data_ptr(), tag & 0xFFFFFFFF,
        device.index or 0, stream,
    )
    lib.check(code, f"burst launch on {target.name}")
    t = ts.cpu().numpy()  # synchronizes with the stream
    if not (t[:, 5] == 1).all():
        raise BurstError(f"{int((t[:, 5] != 1).sum())} of {num_producers} producers waited > 1 s at a start "
                         "barrier: producers were not co-resident (another kernel holding SMs?)")
    cycles = t[:, HEADER_WORDS:].reshape(num_producers, num_bursts, 2).astype(np.float64)
    start, end = cycles[:, :, 0], cycles[:, :, 1]
    kernel_ns = float(np.median(t[:, 2] - t[:, 1]))
    # A long launch carries its own clock: cycles over global-timer ns across the whole run (256 ns
    # timer steps are < 0.3 % of 100 us); a short one uses the probe's clock.
    hz = clock_hz
    if kernel_ns >= 100e3:
        hz = float(np.median((t[:, 4] - t[:, 3]) / np.maximum(t[:, 2] - t[:, 1], 1)) * 1e9)
    return BurstTiming(
        bytes_per_producer=bytes_per_producer,
        num_producers=num_producers,
        num_bursts=num_bursts,
        gap_iters=int(gap_iters),
        issue_s=(end - start) / hz,
        gap_s=(start[:, 1:] - end[:, :-1]) / hz,
        period_s=(start[:, 1:] - start[:, :-1]) / hz,
        sm_ids=t[:, 0].copy(),
        clock_hz=hz,
        kernel_s=kernel_ns * 1e-9,
        aligned_every_burst=bool(align_every_burst),
    )


@dataclass(frozen=True)
class GapModel:
    """The time a gap of ``iters`` FMA iterations takes: ``overhead_s + iters * s_per_iter`` (the loop's
    own overhead included), measured where nothing backs up (``measure_gap_model``)."""

    s_per_iter: float
    overhead_s: float

    def iters_for(self, gap_s: float) -> int:
        if gap_s < 0:
            raise ValueError(f"expected gap_s >= 0, got {gap_s}")
        return int(round(max(gap_s - self.overhead_s, 0.0) / self.s_per_iter))

    def gap_s(self, iters: int) -> float:
        return self.overhead_s + iters * self.s_per_iter


def measure_gap_model(device: torch.device, num_producers: int, clock_hz: float, threads: int = DEFAULT_THREADS,
                      iters: int = 4000) -> GapModel:
    """Time the gap loop with one 16-byte store per producer into local HBM (nothing backs up): the
    per-iteration time from ``iters`` vs 0 iterations, and the zero-work overhead."""
    target = local_target(num_producers * VEC_BYTES, device)

    def gap(n: int) -> float:
        t = run_bursts(target, bytes_per_producer=VEC_BYTES, num_producers=num_producers, num_bursts=8,
                       gap_iters=n, clock_hz=clock_hz, threads=threads)
        return float(np.median(t.gap_s[:, 2:]))

    g0 = gap(0)
    gn = gap(iters)
    if not gn > g0 > 0:
        raise BurstError(f"expected the gap loop to take time, got {g0 * 1e9:.1f} ns at 0 and {gn * 1e9:.1f} ns at {iters}")
    return GapModel((gn - g0) / iters, g0)


def expected_pattern(num_producers: int, bytes_per_producer: int, burst: int, tag: int = 0x5EED) -> torch.Tensor:
    """The uint32 words burst ``burst`` leaves in the target: (tag, burst, producer, vector index) per 16 B."""
    vec = bytes_per_producer // VEC_BYTES
    p = torch.arange(num_producers, dtype=torch.int64).repeat_interleave(vec)
    i = torch.arange(vec, dtype=torch.int64).repeat(num_producers)
    words = torch.stack([torch.full_like(p, tag & 0xFFFFFFFF), torch.full_like(p, burst), p, i], dim=1)
    return words.to(torch.int64).flatten()


def check_written(target: BurstTarget, num_producers: int, bytes_per_producer: int, last_burst: int,
                  tag: int = 0x5EED) -> None:
    """Raise unless ``target`` holds the pattern of burst ``last_burst`` (needs ``target.read_back``)."""
    if target.read_back is None:
        raise ValueError(f"expected a target this process can read back, got {target.name}")
    data = target.read_back()[: num_producers * bytes_per_producer]
    words = data.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    want = expected_pattern(num_producers, bytes_per_producer, last_burst, tag)
    bad = (words != want).nonzero()
    if bad.numel():
        j = int(bad[0, 0])
        raise AssertionError(f"{target.name}: {bad.numel()} of {want.numel()} words differ; first at word {j}: "
                             f"expected {int(want[j])}, got {int(words[j])}")
