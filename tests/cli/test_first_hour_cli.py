"""Issue 16, items 2 and 9 on the command line: degree errors that the model's config decides come
before any rank starts (one line, exit status 2, under 3 s, timed), with the same verdict as the ranks'
own checks on every built-in model; and `xstage-dit --version`."""

from __future__ import annotations

import itertools
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

import xstage_dit
from xstage_dit.errors import UsageError
from xstage_dit.cli.validate import check_parallel
from xstage_dit.families import load_transformer, model_names, model_spec
from xstage_dit.families.experts import ExpertShard
from xstage_dit.families.registry import record
from xstage_dit.features import check_degrees
from xstage_dit.features.config import ParallelConfig

ROOT = Path(__file__).resolve().parents[2]
BUDGET_S = 3.0


def _cli(*argv: str) -> tuple[subprocess.CompletedProcess, float]:
    """The command's result and the CPU seconds it used (user + system): the work it did before answering, which
    other processes on a loaded machine (parallel test workers, CI neighbours) do not inflate as they do its wall
    time."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-m", "xstage_dit", *argv], capture_output=True, text=True, env=env,
                          timeout=60, cwd=ROOT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return done, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.mark.parametrize("argv, needle", [
    (["generate", "--model", "tiny-flux", "--sp", "3"], "--sp: expected at most 2"),
    (["generate", "--model", "tiny-flux", "--cfg", "2"], "guidance-distilled"),
    (["generate", "--model", "tiny-wan", "--cfg", "2", "--guidance", "1"], "--guidance > 1"),
    (["generate", "--model", "tiny-hidream", "--sp", "3", "--ep", "3"], "--sp: expected at most 2"),
    (["serve", "--model", "tiny-flux", "--sp", "3"], "--sp: expected at most 2"),
    (["serve", "--model", "tiny-flux", "--cfg", "2"], "guidance-distilled"),
])
def test_degree_errors_are_one_line_exit_2_before_any_rank(argv, needle):
    done, seconds = _cli(*argv)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert lines == [lines[0]] and lines[0].startswith("xstage-dit: error: ") and needle in lines[0], done.stderr
    assert "started" not in done.stderr and "exited" not in done.stderr, done.stderr  # no rank was started
    assert done.stdout == ""
    assert seconds < BUDGET_S, f"expected the error within {BUDGET_S} CPU s, took {seconds:.2f} s"


def _ranks_verdict(transformer, spec, sp: int, ep: int, cfg: int) -> bool:
    """What the ranks decide: ParallelConfig, the model's rules in parallelize, the expert shards."""
    try:
        config = ParallelConfig(sp=sp, ep=ep, cfg=cfg)
        check_degrees(transformer, config)
        if ep > 1:
            experts = record(spec.family).experts
            layers = [m for m in transformer.modules() if type(m).__name__ == experts.layer_class]
            ExpertShard(0, ep).experts(experts.num_experts(layers[0]))
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("model", model_names())
def test_the_pre_check_agrees_with_the_ranks_on_every_built_in_model(model):
    spec = model_spec(model)
    transformer = load_transformer(model, device="meta")  # the architecture only: no weights made
    heads = max(m.heads for m in transformer.modules() if hasattr(m, "heads") and hasattr(m, "processor"))
    sps = sorted({1, 2, 3, heads - 1, heads, heads + 1} - {0})
    for sp, cfg in itertools.product(sps, (1, 2)):
        for ep in sorted({1, 2, 3, sp}):
            ranks = _ranks_verdict(transformer, spec, sp, ep, cfg)
            try:
                check_parallel(spec, ParallelConfig(sp=sp, ep=ep, cfg=cfg))
                pre = True
            except (UsageError, ValueError):  # ValueError: ParallelConfig itself refuses the degrees
                pre = False
            assert pre == ranks, f"{model} sp={sp} ep={ep} cfg={cfg}: pre-check {pre}, ranks {ranks}"


def test_version_is_the_package_version():
    done, _ = _cli("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"xstage-dit {xstage_dit.__version__}"


def test_generate_says_once_that_the_weights_are_random(tmp_path, capsys):
    from xstage_dit.cli import main

    assert main(["generate", "--model", "tiny-flux", "--height", "32", "--width", "32", "--steps", "1",
                 "--no-progress", "--output", str(tmp_path / "fox.png")]) == 0
    out = capsys.readouterr().out
    assert out.count("random weights") == 1 and "--model /path/to/FLUX.1-dev" in out, out
