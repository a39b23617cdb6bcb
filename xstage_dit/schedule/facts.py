"""Facts about the device a schedule runs on, read off the device (never remembered as literals).

    facts = DeviceFacts.from_device(torch.device("cuda", 0))   # 132 SMs, 60 MiB L2 on an H200
    facts = DeviceFacts.cpu()                                   # the CPU / TRITON_INTERPRET path

Schedules take a ``DeviceFacts`` so that the same shape gets the same choice wherever it is asked for
(eager, under torch.compile, in the server's report).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["DeviceFacts"]


@dataclass(frozen=True)
class DeviceFacts:
    """name: device name; num_sms: streaming multiprocessors (the producers of a burst); l2_bytes: L2 cache
    size; compute_capability: (major, minor), (0, 0) off CUDA; is_cuda: a CUDA device."""

    name: str
    num_sms: int
    l2_bytes: int
    compute_capability: tuple[int, int]
    is_cuda: bool

    def __post_init__(self) -> None:
        if self.num_sms < 1:
            raise ValueError(f"expected num_sms >= 1, got {self.num_sms}")
        if self.l2_bytes < 0:
            raise ValueError(f"expected l2_bytes >= 0, got {self.l2_bytes}")

    @staticmethod
    def from_device(device: torch.device | str | int | None = None) -> "DeviceFacts":
        """The facts of ``device`` (None = the current CUDA device, or the CPU without one)."""
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type != "cuda":
            return DeviceFacts.cpu()
        return _cuda_facts(dev.index if dev.index is not None else torch.cuda.current_device())

    @staticmethod
    def from_props(props) -> "DeviceFacts":
        """The facts of a ``torch.cuda.get_device_properties`` result (or anything with its fields)."""
        return DeviceFacts(name=str(props.name), num_sms=int(props.multi_processor_count),
                           l2_bytes=int(getattr(props, "L2_cache_size", 0)),
                           compute_capability=(int(props.major), int(props.minor)), is_cuda=True)

    @staticmethod
    def cpu() -> "DeviceFacts":
        """The CPU (and the Triton interpreter, which runs programs one after another): one producer."""
        return DeviceFacts(name="cpu", num_sms=1, l2_bytes=0, compute_capability=(0, 0), is_cuda=False)


@functools.cache
def _cuda_facts(index: int) -> DeviceFacts:
    return DeviceFacts.from_props(torch.cuda.get_device_properties(index))
