"""The start-up calibration report (`server.startup.calibration_report`) comes from the one provider: the
handle's ``ChosenParams`` where ``parallelize`` ran, else ``params_for`` on this rank; never a second load."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import xstage_dit.server.startup as startup
from xstage_dit.calibration.provider import ChosenParams
from xstage_dit.calibration.result import CalibrationResult
from xstage_dit.xstage import XStageParams


def test_report_uses_the_handles_params_without_loading(monkeypatch):
    monkeypatch.setattr(startup, "params_for", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    p = XStageParams.reference()
    result = CalibrationResult({"local": p, "host": p}, {"gpu_name": "fake"}, "cache")
    handle = SimpleNamespace(calibration=ChosenParams(p, "local", "calibration cache, target local: one rank", result))
    report = startup.calibration_report(torch.device("cuda", 0), handle)
    assert report["available"] is True and report["target"] == "local" and report["params"] == p.to_dict()
    assert report["machine_key"] == {"gpu_name": "fake"} and set(report["targets"]) == {"local", "host"}
    fixed = startup.calibration_report(torch.device("cuda", 0), SimpleNamespace(calibration=None))
    assert fixed["available"] is False and "fixed by the user" in fixed["reason"]


def test_report_without_a_handle_asks_the_provider_on_the_cpu():
    report = startup.calibration_report(torch.device("cpu"))
    assert report == {"available": False, "target": "local", "source": "no calibration: no GPU (cpu)", "params": None,
                      "reason": "no calibration: no GPU (cpu)"}
