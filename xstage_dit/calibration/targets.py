"""Calibration targets: the names, which of them this machine has, and the error for one it lacks.

"local" = this GPU's HBM (the control), "host" = host-pinned memory over PCIe, "nvlink" = a peer GPU's
memory (two processes, `peer.py`).
"""

from __future__ import annotations

from typing import Any

TARGETS = ("local", "host", "nvlink")

__all__ = ["TARGETS", "CalibrationUnavailable", "check_target", "resolve_device", "available_targets",
           "resolve_targets"]


class CalibrationUnavailable(RuntimeError):
    """No calibration can run here (no GPU, no nvcc, target missing on this machine)."""


def check_target(target: str) -> None:
    """Raise ValueError unless ``target`` is one of ``TARGETS``."""
    if target not in TARGETS:
        raise ValueError(f"expected a target in {TARGETS}, got {target!r}")


def resolve_device(device: Any):
    """``device`` (None = current, an index, a string) as an indexed CUDA device; CalibrationUnavailable off CUDA."""
    import torch

    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda":
        raise CalibrationUnavailable(f"expected a CUDA device to calibrate, got {dev}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.index >= torch.cuda.device_count():
        raise ValueError(f"expected a device index < {torch.cuda.device_count()}, got {dev.index}")
    return dev


def available_targets(device: Any = None, *, allow_shared_gpu: bool = False) -> list[str]:
    """Targets this machine can calibrate: local and host always (with a GPU); nvlink with a second GPU
    this one can reach with peer access (or two processes sharing one GPU when ``allow_shared_gpu``)."""
    import torch

    dev = resolve_device(device)
    out = ["local", "host"]
    n = torch.cuda.device_count()
    if any(j != dev.index and torch.cuda.can_device_access_peer(dev.index, j) for j in range(n)) or allow_shared_gpu:
        out.append("nvlink")
    return out


def resolve_targets(target: str, device: Any = None, *, allow_shared_gpu: bool = False) -> list[str]:
    """The targets named by ``target`` ("auto", one name, or a comma-separated list), checked against
    this machine; an unavailable target is a CalibrationUnavailable naming it."""
    avail = available_targets(device, allow_shared_gpu=allow_shared_gpu)
    if target == "auto":
        return avail
    wanted = [t.strip() for t in target.split(",") if t.strip()]
    for t in wanted:
        check_target(t)
        if t not in avail:
            import torch

            raise CalibrationUnavailable(
                f"target {t!r} is not available on this machine (available: {avail}); nvlink needs a second GPU "
                f"with peer access, found {torch.cuda.device_count()} GPU(s)")
    return wanted

