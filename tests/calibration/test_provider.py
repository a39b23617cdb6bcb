"""`calibration.provider.params_for`: the one target rule and the one loader of calibrated params, on the CPU.

Real gloo groups of 1 and 2 ranks for the collective parts; a fake result object and a patched GPU-index
gather for the choices that need GPUs (ranks on separate GPUs -> nvlink, ranks sharing one -> local).
"""

from __future__ import annotations

import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from xstage_dit.calibration import provider
from xstage_dit.calibration.provider import ChosenParams, params_for, serving_target
from xstage_dit.comm.launcher import run_rank_processes
from xstage_dit.xstage import XStageParams

LOCAL = XStageParams(132, 0.6e-6, 4.8e12, float("inf"), float("inf"))
NVLINK = XStageParams(132, 0.8e-6, 4.8e12, 400e9, 8e6)


class FakeResult:
    """The two attributes of a CalibrationResult the provider reads."""

    def __init__(self, params: dict, source: str = "cache") -> None:
        self.params = params
        self.source = source


@pytest.fixture
def world_of_two(monkeypatch):
    """The provider sees an initialized world of 2 ranks (this one rank 0); collectives are not run."""
    monkeypatch.setattr(provider.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(provider.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(provider.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(provider.dist, "barrier", lambda group=None: None)


def test_cpu_device_is_local_without_params():
    chosen = params_for("cpu", None, allow_measure=True)
    assert chosen == ChosenParams(None, "local", "no calibration: no GPU (cpu)")
    assert chosen.describe() == {"target": "local", "source": "no calibration: no GPU (cpu)", "params": None}


def test_one_rank_on_a_gpu_chooses_local():
    chosen = params_for(torch.device("cuda", 0), None, result=FakeResult({"local": LOCAL, "nvlink": NVLINK}))
    assert chosen.params is LOCAL and chosen.target == "local"
    assert "one rank" in chosen.source and "calibration cache" in chosen.source
    assert chosen.describe()["params"] == LOCAL.to_dict()


def test_ranks_on_separate_gpus_choose_nvlink(world_of_two, monkeypatch):
    monkeypatch.setattr(provider, "_gpu_indices", lambda device, group: [0, 1])
    chosen = params_for(torch.device("cuda", 0), None, result=FakeResult({"local": LOCAL, "nvlink": NVLINK}))
    assert chosen.params is NVLINK and chosen.target == "nvlink"
    assert "GPUs [0, 1]" in chosen.source


def test_ranks_sharing_one_gpu_choose_local(world_of_two, monkeypatch):
    monkeypatch.setattr(provider, "_gpu_indices", lambda device, group: [0, 0])
    assert serving_target(torch.device("cuda", 0)) == ("local", "2 ranks share GPU 0: stores stay in its HBM")
    chosen = params_for(torch.device("cuda", 0), None, result=FakeResult({"local": LOCAL, "nvlink": NVLINK}))
    assert chosen.params is LOCAL and chosen.target == "local"


def test_nvlink_never_calibrated_falls_back_to_local_and_says_so(world_of_two, monkeypatch):
    monkeypatch.setattr(provider, "_gpu_indices", lambda device, group: [0, 1])
    chosen = params_for(torch.device("cuda", 0), None, result=FakeResult({"local": LOCAL, "host": NVLINK}))
    assert chosen.params is LOCAL and chosen.target == "local"
    assert "no nvlink target" in chosen.source
    # host (PCIe) numbers are a measurement target only, never served
    none = params_for(torch.device("cuda", 0), None, result=FakeResult({"host": NVLINK}))
    assert none.params is None and none.target == "nvlink" and "no nvlink target" in none.source


def test_loading_goes_through_the_cache_unless_measuring_is_allowed(monkeypatch):
    calls = []
    monkeypatch.setattr(provider, "machine_key", lambda device: {"gpu": "fake"})
    monkeypatch.setattr(provider, "load_cache", lambda key: calls.append(("cache", key)))
    monkeypatch.setattr(provider, "load_or_calibrate",
                        lambda device, quick: calls.append(("measure", quick)) or FakeResult({"local": LOCAL}, "measured"))
    missing = params_for(torch.device("cuda", 0), None)
    assert missing.params is None and "run `xstage-dit calibrate`" in missing.source
    assert calls == [("cache", {"gpu": "fake"})]
    measured = params_for(torch.device("cuda", 0), None, allow_measure=True)
    assert measured.params is LOCAL and "calibration measured" in measured.source
    assert calls[-1] == ("measure", True)


def test_other_ranks_read_rank_0s_cache_and_never_measure(world_of_two, monkeypatch):
    calls = []
    monkeypatch.setattr(provider.dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(provider, "_gpu_indices", lambda device, group: [0, 0])
    monkeypatch.setattr(provider, "machine_key", lambda device: {"gpu": "fake"})
    monkeypatch.setattr(provider, "load_cache", lambda key: calls.append("cache") or FakeResult({"local": LOCAL}))
    monkeypatch.setattr(provider, "load_or_calibrate", lambda device, quick: calls.append("measure"))
    chosen = params_for(torch.device("cuda", 0), None, allow_measure=True)
    assert chosen.params is LOCAL and calls == ["cache"]


def test_a_failed_measurement_is_a_reason_not_an_exception(monkeypatch, caplog):
    def broken(device, quick):
        raise RuntimeError("burst kernel crashed")

    monkeypatch.setattr(provider, "load_or_calibrate", broken)
    with caplog.at_level("WARNING", logger=provider.__name__):
        chosen = params_for(torch.device("cuda", 0), None, allow_measure=True)
    assert chosen.params is None and "RuntimeError: burst kernel crashed" in chosen.source
    assert "burst kernel crashed" in caplog.text


def _gloo_rank(rank: int, world: int, port: int, queue) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        try:
            chosen = params_for("cpu", None, allow_measure=True)
            # the real all-gather of the target rule, with CPU tensors standing in for GPU indices
            gathered = provider.all_gather_list(torch.tensor([rank % 2]), None)
            queue.put((rank, (chosen.target, chosen.params, chosen.source, [int(t) for t in gathered])))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        queue.put((rank, traceback.format_exc()))


@pytest.mark.parametrize("world", [1, 2])
def test_gloo_group_on_the_cpu(world):
    results = run_rank_processes(_gloo_rank, world, start_method="fork", timeout_s=120, join_s=5)
    for rank in range(world):
        res = results[rank]
        assert not isinstance(res, str), res
        target, params, source, gathered = res
        assert (target, params, source) == ("local", None, "no calibration: no GPU (cpu)")
        assert gathered == [r % 2 for r in range(world)]
