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


def test_calibration_route_shows_each_shapes_kernel_choice(monkeypatch):
    """Through the production loader and the HTTP route (world 1, CPU): the warm-up decided each shape; the
    report names the kernel, both reasons and the timings (faked: FA4 takes the shape, torch SDPA measured
    faster), and the sweep's families."""
    import httpx

    import xstage_dit.features.attention_kernels as ak
    from xstage_dit.calibration.kernel_sweep import KernelSweep
    from xstage_dit.features.config import ParallelConfig
    from xstage_dit.server.app import create_app
    from xstage_dit.server.config import ServerConfig
    from xstage_dit.server.ranks import RankContext
    from xstage_dit.server.worker import Worker
    from tests.helpers.server import live_server

    monkeypatch.setattr(ak, "problem_refusals", lambda **problem: {"sdpa": None, "fa4": None})
    monkeypatch.setattr(ak.KernelChooser, "_machine_sweep", lambda self, problem, family, measure: KernelSweep(
        {}, {family: {"sdpa": 0.5, "fa4": 0.7}}, "measured", path="/cache/kernel-sweep-x.json"))
    worker = Worker(startup.model_loader("tiny-flux", ParallelConfig()), ServerConfig(api_key=None),
                    join=lambda: RankContext(device=torch.device("cpu"))).start()
    try:
        assert worker.wait_ready(120), worker.reason
        with live_server(create_app(worker)) as url, httpx.Client(base_url=url, timeout=30) as client:
            report = client.get("/v1/calibration").json()
    finally:
        worker.stop()
    decisions = list(report["schedules"].values())
    assert decisions, report
    for d in decisions:
        assert d["name"] == "serial" and d["kernel"] == "sdpa" and "world size 1" in d["reason"], d
        assert d["kernel_reason"] == "fastest measured on this machine: sdpa 0.500 ms (vs fa4 0.700 ms)", d
        assert d["timings_ms"] == {"sdpa": 0.5, "fa4": 0.7} and d["baseline_ms"] == 0.5
    families = report["attention_kernels"]["families"]
    assert families and all(f == {"timings_ms": {"sdpa": 0.5, "fa4": 0.7}, "source": "measured",
                                  "path": "/cache/kernel-sweep-x.json"} for f in families.values()), families


def test_calibration_route_shows_the_patches_outside_the_transformer():
    """NucleusMoE (CFG, Qwen-Image VAE) served at world 1 on the CPU, as `serve` configures it (``--cfg-batch
    auto``): after the warm-up and one request, the report counts the empty negative prompt's cache use, the VAE's
    one-frame decodes and CFG batching's pairs, and says why CFG batching is on."""
    import httpx

    from xstage_dit.features.config import ParallelConfig
    from xstage_dit.server.app import create_app
    from xstage_dit.server.config import ServerConfig
    from xstage_dit.server.ranks import RankContext
    from xstage_dit.server.worker import Worker
    from tests.helpers.server import live_server

    worker = Worker(startup.model_loader("tiny-nucleusmoe", ParallelConfig(cfg_batch="auto")), ServerConfig(api_key=None),
                    join=lambda: RankContext(device=torch.device("cpu"))).start()
    try:
        assert worker.wait_ready(180), worker.reason
        with live_server(create_app(worker)) as url, httpx.Client(base_url=url, timeout=120) as client:
            before = client.get("/v1/calibration").json()["outside_transformer"]
            answer = client.post("/v1/images/generations", json={"prompt": "a red fox", "num_inference_steps": 2,
                                                                  "seed": 3})
            assert answer.status_code == 200, answer.text
            after = client.get("/v1/calibration").json()["outside_transformer"]
    finally:
        worker.stop()
    assert before["vae_convs_2d"] > 0 and before["vae_one_frame_decode"]["compiled"] is False  # off on the CPU
    assert before["empty_prompt_cache"]["misses"] >= 1  # the warm-up encoded "" once
    assert after["empty_prompt_cache"]["hits"] == before["empty_prompt_cache"]["hits"] + 1
    assert after["empty_prompt_cache"]["misses"] == before["empty_prompt_cache"]["misses"]
    assert after["vae_one_frame_decode"]["calls"] == before["vae_one_frame_decode"]["calls"] + 1
    assert after["cfg_batch_reason"].startswith("on (cfg_batch=auto)")
    assert after["cfg_batch"]["batched_pairs"] == before["cfg_batch"]["batched_pairs"] + 2  # 2 steps, 1 forward each
