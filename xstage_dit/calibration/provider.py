"""The one provider of calibrated X-Stage params: which target applies, and its numbers.

    chosen = params_for(torch.device("cuda", 0), group)          # ChosenParams(params, target, source)
    chosen.params.drain_rate_Bps if chosen.params else None

Everything that needs the calibrated numbers (``parallelize``, the server's report, benchmarks) asks
here, once, and hands the result down; ops never load a cache or calibrate. The target rule:

- world 1, or every rank of ``group`` on the same GPU (processes sharing one GPU): the remote stores
  land in this GPU's own HBM -> ``local``;
- ranks on separate GPUs -> ``nvlink`` (the peer target), or ``local`` when ``nvlink`` was never
  calibrated (then the reason says so).

``host`` (host-pinned memory over PCIe) is a measurement target only, never chosen for serving.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

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
    mine = torch.tensor([device.index if device.index is not None else torch.cuda.current_device()],
                        dtype=torch.int64)
    if group is None and not dist.is_initialized():
        return [int(mine)]
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


def params_for(device: torch.device | str | None, group=None, *, allow_measure: bool = False,
               result: Any = None) -> ChosenParams:
    """The calibrated params that apply to ``group``'s ranks on ``device`` (collective over ``group``).

    device: the rank's device (None = current CUDA device). allow_measure: on a cache miss, measure (a
    quick calibration, rank 0 first and the others then read its cache); False = cache only.
    result: an already loaded CalibrationResult to choose from (no loading at all).
    Never raises for a missing calibration: ``params`` is None and ``source`` says why.
    """
    from xstage_dit.calibration.runner import CalibrationUnavailable, load_cache, load_or_calibrate, machine_key

    dev = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    target, why = serving_target(dev, group)
    if dev.type != "cuda":
        return ChosenParams(None, target, f"no calibration: {why}")
    if result is None:
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        error = None

        def load():
            try:
                if allow_measure:
                    return load_or_calibrate(dev, quick=True)
                return load_cache(machine_key(dev), None, ["local"])
            except CalibrationUnavailable as exc:
                return exc

        # One measurement per machine: rank 0 first, the others then read what it cached.
        loaded = load() if rank == 0 else None
        if world > 1:
            dist.barrier(group)
        if rank != 0:
            loaded = load()
        if isinstance(loaded, Exception):
            error, loaded = loaded, None
        if loaded is None:
            how = f"({error})" if error else "(no cached calibration; run `xstage-dit calibrate`)"
            return ChosenParams(None, target, f"no calibration {how}")
        result = loaded
    params = result.params.get(target)
    source = f"calibration {result.source}, target {target}: {why}"
    if params is None and target == "nvlink" and "local" in result.params:
        return ChosenParams(None, target, f"calibration {result.source} has no nvlink target ({why})", result)
    if params is None:
        return ChosenParams(None, target, f"calibration {result.source} has no {target} target", result)
    return ChosenParams(params, target, source, result)
