"""--cache and its --cache-* parameters on generate, serve and bench: the `StepCacheConfig` they make, the errors
(one line, exit 2, naming the option, before any rank starts), serve handing them to its ranks, and generate's
report of what the cache computed; at sp = 2 generate writes the one-process image."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from xstage_dit.cli import build_parser, main
from xstage_dit.cli.engine_options import feature_switches
from xstage_dit.engine import EngineConfig
from xstage_dit.features.step_cache import StepCacheConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_the_options_make_the_config(command):
    parser = build_parser()
    args = parser.parse_args([command, "--cache", "magcache", "--cache-max-skip", "2", "--cache-mag-ratios", "flat",
                              "--cache-threshold", "0.1"])
    if command == "bench":
        from xstage_dit.features.step_cache.options import cache_config

        assert cache_config(args) == StepCacheConfig("magcache", threshold=0.1, max_skip=2, mag_ratios="flat")
        return
    switches = feature_switches(args)
    assert switches == {"cache": StepCacheConfig("magcache", threshold=0.1, max_skip=2, mag_ratios="flat")}
    assert EngineConfig(**switches).stack_config("image").cache == switches["cache"]
    assert feature_switches(parser.parse_args([command])) == {}


def test_serve_hands_the_cache_options_to_its_ranks():
    from xstage_dit.cli.serve import _argv

    args = build_parser().parse_args(["serve", "--cache", "taylorseer", "--cache-lite", "--cache-interval", "3"])
    again = build_parser().parse_args(_argv(args))
    assert feature_switches(again) == feature_switches(args) == {"cache": StepCacheConfig("taylorseer", interval=3,
                                                                                          lite=True)}


@pytest.mark.parametrize("argv, needle", [
    (["generate", "--cache", "pab", "--cache-threshold", "0.1"], "--cache-threshold: cache threshold applies to"),
    (["generate", "--cache-interval", "3"], "--cache-interval: expected --cache with it"),
    (["generate", "--cache", "taylorseer", "--cache-warmup-steps", "0"], "--cache-warmup-steps: expected cache"),
    (["generate", "--cache", "pab", "--cache-timestep-range", "800,100"], "--cache-timestep-range: expected a timestep"),
    (["generate", "--cache", "fbcache", "--compile", "graphs"], "--cache: fbcache with --compile graphs"),
    (["generate", "--model", "tiny-wan", "--cfg", "2", "--guidance", "5", "--cache", "fastercache"],
     "--cache: fastercache under --cfg 2"),
    (["serve", "--model", "tiny-qwenimage", "--cfg", "2", "--cache", "pab"], "--cache: pab under --cfg 2"),
])
def test_bad_options_are_one_line_exit_2_naming_the_option(argv, needle):
    done = subprocess.run([sys.executable, "-m", "xstage_dit", *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and needle in lines[0], done.stderr
    assert "started" not in done.stderr  # no rank was started


def test_generate_reports_the_cache_and_two_ranks_write_the_one_process_image(tmp_path, capsys):
    common = ["generate", "--model", "tiny-flux", "--steps", "4", "--height", "64", "--width", "64", "--seed", "3",
              "--no-progress", "--cache", "fbcache", "--cache-compute-every", "2"]
    one = tmp_path / "one.png"
    assert main([*common, "--output", str(one)]) == 0
    assert "step cache fbcache: 2 steps computed, 2 skipped" in capsys.readouterr().out
    two = tmp_path / "two.png"
    done = subprocess.run([sys.executable, "-m", "xstage_dit", *common, "--sp", "2", "--output", str(two)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step cache fbcache: 2 steps computed, 2 skipped" in done.stdout
    a, b = (np.asarray(Image.open(p), dtype=np.int16) for p in (one, two))
    assert np.abs(a - b).max() <= 1  # sharded attention sums in another order: one uint8 level at most
