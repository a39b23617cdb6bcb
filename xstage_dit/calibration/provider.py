"""The one provider of calibrated X-Stage params: which target applies, and its numbers.

    chosen = params_for(torch.device("cuda", 0), group)          # ChosenParams(params, target, source)
    chosen.params.drain_rate_Bps if chosen.params else None

Everything that needs the calibrated numbers (``parallelize``, the server's report, benchmarks) asks
here, once, and hands the result down; ops never load a cache or calibrate. The target rule:

- world 1, or every rank of ``group`` on the same GPU (processes sharing one GPU): the remote stores
  land in this GPU's own HBM -> ``local``;
- ranks on separate GPUs -> ``nvlink`` (the peer target), or ``local`` when ``nvlink`` was never
  calibrated (then the reason says so).

Loading is collective over the whole world (rank 0 loads or measures first, the others then read its
cache: one measurement per machine, also when several groups share it); the target rule is collective
over ``group`` (one all-gather of GPU indices). Every rank calls ``params_for`` once.

``host`` (host-pinned memory over PCIe) is a measurement target only, never chosen for serving.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from xstage_dit.calibration.cache import load_cache, machine_key
from xstage_dit.calibration.runner import load_or_calibrate
from xstage_dit.calibration.targets import CalibrationUnavailable
from xstage_dit.comm.staged import all_gather_list
from xstage_dit.xstage import XStageParams

log = logging.getLogger(__name__)

__all__ = ["ChosenParams", "params_for", "serving_target"]


@dataclass(frozen=True)
class ChosenParams:
    """params: the calibrated numbers for ``target``, or None where none exist (then ``source`` says why).
    target: "local" | "nvlink". source: where the numbers came from ("cache", "measured", ...) or why
    there are none. result: the whole CalibrationResult (every target), for reports; None without one."""

    params: XStageParams | None
    target: str
    source: str
    result: Any = None

    def describe(self) -> dict:
        """A JSON-able summary: target, source and the numbers (for logs and /v1/calibration)."""
        p = self.params
        return {"target": self.target, "source": self.source,
                "params": None if p is None else p.to_dict()}


def _gpu_indices(device: torch.device, group) -> list[int]:
    """The CUDA device index of every rank of ``group`` (one small all-gather; [this one] at world 1)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if group is None and not dist.is_initialized():
        return [index]
    # On the device, so that NCCL takes it as it is (gloo stages it through the host).
    mine = torch.tensor([index], dtype=torch.int64, device=device)
    # Within one host the index identifies the GPU. (Ranks on other hosts never share this GPU; a group
    # spanning hosts has distinct indices or is remote anyway: either way "nvlink"-class, not local HBM.)
    return [int(t) for t in all_gather_list(mine, group)]


def serving_target(device: torch.device, group=None) -> tuple[str, str]:
    """("local" | "nvlink", reason) for the ranks of ``group`` on ``device`` (see the module docstring)."""
    if device.type != "cuda":
        return "local", f"no GPU ({device.type})"
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return "local", "one rank: stores stay in this GPU's HBM"
    indices = _gpu_indices(device, group)
    if len(set(indices)) == 1:
        return "local", f"{world} ranks share GPU {indices[0]}: stores stay in its HBM"
    return "nvlink", f"{world} ranks on GPUs {sorted(set(indices))}: stores cross NVLink"


def _load(device: torch.device, allow_measure: bool):
    """This machine's CalibrationResult, or the reason there is none (a str)."""
    try:
        if allow_measure:
            return load_or_calibrate(device, quick=True)
        return load_cache(machine_key(device)) or "no cached calibration; run `xstage-dit calibrate`"
    except CalibrationUnavailable as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - a failed measurement must not leave the other ranks at the barrier
        log.warning("X-Stage calibration failed, schedules go without it: %s: %s", type(exc).__name__, exc)
        return f"calibration failed ({type(exc).__name__}: {exc})"


def _resolve(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def params_for(device: torch.device | str | None, group=None, *, allow_measure: bool = False,
               result: Any = None) -> ChosenParams:
    """The calibrated params that apply to ``group``'s ranks on ``device`` (collective: see the module docstring).

    device: the rank's device (None = current CUDA device, else the CPU). group: the ranks that store into
    each other's memory (None = the default group). allow_measure: on a cache miss, measure (a quick
    calibration, rank 0 first and the others then read its cache); False = cache only. result: an already
    loaded CalibrationResult to choose from (no loading at all, nothing collective but the target rule).
    Never raises for a missing or failed calibration: ``params`` is None and ``source`` says why.

    Example: ``params_for("cuda:0", sp_group, allow_measure=True).params.drain_rate_Bps``.
    """
    dev = _resolve(device)
    target, why = serving_target(dev, group)
    if dev.type != "cuda":
        return ChosenParams(None, target, f"no calibration: {why}")
    if result is None:
        loaded = None
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0:
            loaded = _load(dev, allow_measure)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # rank 0's measurement is cached before anyone else looks
        if rank != 0:
            # Read what rank 0 cached (the machine key holds no device index): never a second measurement,
            # also when rank 0's failed.
            loaded = _load(dev, allow_measure=False)
        if isinstance(loaded, str):
            return ChosenParams(None, target, f"no calibration ({loaded})")
        result = loaded
    params = result.params.get(target)
    if params is None and target == "nvlink" and "local" in result.params:
        return ChosenParams(result.params["local"], "local",
                            f"calibration {result.source} has no nvlink target, local HBM numbers instead ({why})",
                            result)
    if params is None:
        return ChosenParams(None, target, f"calibration {result.source} has no {target} target ({why})", result)
    return ChosenParams(params, target, f"calibration {result.source}, target {target}: {why}", result)
