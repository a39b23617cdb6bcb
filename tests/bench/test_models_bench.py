"""The benchmark plumbing (benchmarks/_common.py, bench_flux_step.py) on the CPU with the tiny model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks/ is not installed
from benchmarks import _common  # noqa: E402


def test_time_ms_measures_the_call():
    calls = []
    stats = _common.time_ms(lambda: calls.append(torch.ones(64, 64) @ torch.ones(64, 64)), warmup=2, reps=5,
                            device="cpu")
    assert len(calls) == 7
    assert stats["reps"] == 5 and 0 < stats["min_ms"] <= stats["median_ms"] <= stats["max_ms"]
    assert stats["p20_ms"] <= stats["p80_ms"]
    with pytest.raises(ValueError, match="reps >= 1"):
        _common.time_ms(lambda: None, reps=0)


def test_markdown_table_and_environment():
    table = _common.markdown_table([{"a": 1, "b": 0.123456}, {"a": 2, "b": None}], ["b", "a"])
    assert table.splitlines() == ["| b | a |", "|---|---|", "| 0.1235 | 1 |", "|  | 2 |"]
    env = _common.environment()
    for key in ("torch", "triton", "diffusers", "git_commit", "gpu", "driver", "time_utc"):
        assert key in env
    assert env["git_commit"] != ""


def test_bench_flux_step_writes_json_and_markdown(tmp_path):
    from benchmarks import bench_flux_step

    stem = tmp_path / "flux-step-test"
    rc = bench_flux_step.main(["--sizes", "tiny", "--device", "cpu", "--dtype", "float32", "--height", "32",
                               "--width", "48", "--text-tokens", "8", "--warmup", "1", "--reps", "2",
                               "--out", str(stem)])
    assert rc == 0
    data = json.loads(stem.with_suffix(".json").read_text())
    assert data["benchmark"] == "flux-step"
    (row,) = data["rows"]
    assert (row["model"], row["resolution"], row["image_tokens"], row["text_tokens"]) == ("tiny-flux", "48x32", 6, 8)
    assert row["median_ms"] > 0 and data["summary"]["tiny_flux_step_ms"] == row["median_ms"]
    assert "| tiny-flux |" in stem.with_suffix(".md").read_text()
    with pytest.raises(SystemExit):
        bench_flux_step.main(["--sizes", "huge"])


def test_transformer_inputs_validate_and_match_the_pipeline():
    from diffusers import FluxPipeline

    from xstage_dit.families.flux_inputs import image_ids, transformer_inputs

    ours = image_ids(3, 5, device="cpu", dtype=torch.float32)
    theirs = FluxPipeline._prepare_latent_image_ids(1, 3, 5, "cpu", torch.float32)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)

    class Cfg:
        in_channels, joint_attention_dim, pooled_projection_dim, guidance_embeds = 16, 32, 32, True

    with pytest.raises(ValueError, match="got 40"):
        transformer_inputs(Cfg, height=40, width=64, device="cpu")
