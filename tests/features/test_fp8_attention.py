"""FP8 attention's selection on the CPU (`features.fp8`'s ``attention`` and the `KernelChooser`), with fake sweeps
and refusals: off unless asked for, the 8-bit kernels timed in their own "-fp8" family beside the 16-bit ones and
chosen only where measured faster, a kernel asked for by name running fused without the design test, the capture
refusal under CUDA graphs, the config and CLI errors naming the bad value, and the stack's refusal where no
attention kernel choice exists or the device is a CPU (nothing converted, nothing left behind)."""

from __future__ import annotations

import argparse

import pytest
import torch

from xstage_dit.calibration.kernel_sweep import KernelSweep
from xstage_dit.cli.engine_options import add_feature_options, check_quantize, feature_switches
from xstage_dit.engine import Engine, EngineConfig
from xstage_dit.errors import UsageError
from xstage_dit.families import load_pipeline
from xstage_dit.features.attention_kernels import KernelChooser
from xstage_dit.features.compile import CompileConfig
from xstage_dit.features.config import ParallelConfig
from xstage_dit.features.fp8 import Fp8Config
from xstage_dit.ops.attention.auto import resolve_attention_decision
from xstage_dit.schedule.attention_kernel import FP8_KERNELS

CPU = torch.device("cpu")
FLUX = dict(batch=1, seq_len=4608, heads=24, head_dim=128, dtype=torch.bfloat16)


class FakeSweep:
    def __init__(self, timings=None):
        self.timings, self.calls = timings, []

    def __call__(self, problem, family, measure):
        self.calls.append((family, problem.get("fp8")))
        return None if self.timings is None else KernelSweep({}, {family: dict(self.timings)}, "fake")


class FakeRefusals:
    """Every named kernel takes the problem (the ``refuse`` ones say why not); records the fp8 flag asked."""

    def __init__(self, *names, refuse=()):
        self.names, self.refuse, self.asked = names, refuse, []

    def __call__(self, fp8=False, **problem):
        self.asked.append(fp8)
        names = self.names + (FP8_KERNELS if fp8 else ())
        return {n: (f"{n} refuses (test)" if n in self.refuse else None) for n in names}


def _chooser(world, timings, refusals, mode="off"):
    chooser = KernelChooser(world=world, allow_measure=True, sweep=FakeSweep(timings), refusals=refusals)
    chooser.use_fp8_attention(mode)
    return chooser


def test_off_unless_asked_and_only_for_16bit_inputs():
    timings = {"sdpa": 2.0, "fa4": 1.9, "cudnn-fp8": 1.0}
    refusals = FakeRefusals("sdpa", "fa4")
    chooser = _chooser(1, timings, refusals)
    assert chooser.choose(**FLUX, device=CPU).name == "fa4" and refusals.asked == [False]
    assert chooser._sweep.calls == [("bfloat16-d128-b1-s8192-hr24-p1", False)]
    chooser.use_fp8_attention("auto")
    fp32 = chooser.choose(**{**FLUX, "dtype": torch.float32}, device=CPU)
    assert fp32.name == "fa4" and refusals.asked[-1] is False  # nothing 8-bit quantizes from fp32


def test_auto_times_the_8bit_kernels_in_their_own_family_and_picks_the_fastest():
    refusals = FakeRefusals("sdpa", "fa4", "cudnn")
    chooser = _chooser(1, {"sdpa": 2.0, "fa4": 1.9, "cudnn": 1.8, "cudnn-fp8": 1.2, "sage": 1.5}, refusals, "auto")
    choice = chooser.choose(**FLUX, device=CPU)
    assert choice.name == "cudnn-fp8" and not choice.forced and "fastest measured" in choice.reason
    assert chooser._sweep.calls == [("bfloat16-d128-b1-s8192-hr24-p1-fp8", True)] and refusals.asked == [True]
    decision = resolve_attention_decision(None, choice, world_size=1, device=CPU, **FLUX)
    assert decision.name == "fused:cudnn-fp8"
    # Slower than a 16-bit kernel at this shape: not chosen (FP8 attention is a candidate, not a mandate).
    slower = _chooser(1, {"sdpa": 2.0, "fa4": 1.1, "cudnn-fp8": 1.2, "sage": 1.5}, FakeRefusals("sdpa", "fa4"), "auto")
    assert slower.choose(**FLUX, device=CPU).name == "fa4"
    # Unmeasured 8-bit kernels are never preferred: they come after every 16-bit kernel in the order.
    world4 = _chooser(4, None, FakeRefusals("fa4", "cudnn", "triton"), "auto")
    assert world4.choose(**FLUX, device=CPU).name == "fa4"


def test_a_kernel_asked_for_by_name_runs_fused_wherever_it_takes_the_shape():
    for world in (1, 4):
        refusals = FakeRefusals("sdpa", "fa4", "triton")
        chooser = _chooser(world, {"sdpa": 1.0, "fa4": 0.5, "sage": 9.0}, refusals, "sage")
        choice = chooser.choose(**FLUX, device=CPU)
        assert (choice.name, choice.forced) == ("sage", True) and "asked for" in choice.reason
        assert chooser._sweep.calls == []  # nothing timed
        decision = resolve_attention_decision(None, choice, world_size=world, device=CPU, **FLUX)
        assert decision.name == "fused:sage" and (world == 1 or "no design test" in decision.reason)
    # Where it refuses the shape, the choice is what it would have been (the sweep, then the design test).
    refusing = _chooser(1, {"sdpa": 1.0, "fa4": 0.5}, FakeRefusals("sdpa", "fa4", refuse=("sage",)), "sage")
    choice = refusing.choose(**FLUX, device=CPU)
    assert choice.name == "fa4" and not choice.forced and "sage refuses (test)" in str(choice.refused)


def test_cuda_graphs_refuse_cudnn_fp8_at_every_world_size_and_the_undo_restores():
    for world in (1, 2):
        chooser = _chooser(world, {"sdpa": 2.0, "fa4": 1.9, "cudnn-fp8": 1.0, "sage": 1.5},
                           FakeRefusals("sdpa", "fa4"), "auto")
        undo = chooser.for_cuda_graphs()
        assert "cudnn-fp8" in chooser.capture_refusals
        assert chooser.choose(**FLUX, device=CPU).name == "sage"
        undo()
        assert chooser.capture_refusals == {}
    chooser = KernelChooser(world=1, sweep=FakeSweep(None))
    undo = chooser.use_fp8_attention("auto")
    assert chooser.fp8_attention == "auto"
    undo()
    assert chooser.fp8_attention == "off"
    with pytest.raises(ValueError, match="expected fp8 attention in off, auto, cudnn-fp8, sage, got 'fp4'"):
        chooser.use_fp8_attention("fp4")


def test_config_and_cli_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="expected fp8 attention in off, auto, cudnn-fp8, sage, got 'on'"):
        Fp8Config(attention="on")
    with pytest.raises(ValueError, match="expected fp8_attention in off, auto, cudnn-fp8, sage, got 'yes'"):
        EngineConfig(quantize="fp8", fp8_attention="yes")
    with pytest.raises(ValueError, match="expected quantize 'fp8' with fp8_attention 'auto'.*got quantize 'none'"):
        EngineConfig(fp8_attention="auto")
    assert EngineConfig(quantize="fp8", fp8_attention="sage").stack_config("image").fp8 == Fp8Config(attention="sage")
    assert EngineConfig(quantize="fp8").stack_config("image").fp8.attention == "off"
    parser = argparse.ArgumentParser()
    add_feature_options(parser)
    args = parser.parse_args(["--fp8-attention", "auto"])
    with pytest.raises(UsageError, match="--fp8-attention auto: expected --quantize fp8 .* got --quantize none"):
        check_quantize(args, "cpu")
    args = parser.parse_args(["--quantize", "fp8", "--fp8-granularity", "weight", "--fp8-attention", "cudnn-fp8"])
    check_quantize(args, "cpu")  # weight-only FP8 runs anywhere; the kernels refuse a CPU when the stack applies
    assert feature_switches(args) == {"quantize": "fp8", "fp8_granularity": "weight", "fp8_attention": "cudnn-fp8"}
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantize", "fp8", "--fp8-attention", "fa4"])  # a 16-bit kernel is not an FP8 mode


def _weights(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("parallel, why", [
    (None, "expected the parallel features with schedule 'auto', got no parallel features"),
    (ParallelConfig(schedule="serial", calibrate=False), "got schedule 'serial'"),
    (ParallelConfig(calibrate=False), "runs 8-bit attention kernels on a CUDA GPU, got device cpu"),
])
def test_the_stack_refuses_fp8_attention_it_cannot_run_and_leaves_nothing(parallel, why):
    pipe = load_pipeline("tiny-flux", dtype=torch.bfloat16, device="cpu", seed=0)
    before = _weights(pipe.transformer)
    engine = Engine(EngineConfig(device="cpu", dtype="bfloat16", parallel=parallel, compile=CompileConfig("off"),
                                 quantize="fp8", fp8_granularity="weight", fp8_attention="auto"))
    with pytest.raises(ValueError, match=why):
        engine.apply(pipe, kind="image")
    after = _weights(pipe.transformer)
    assert after.keys() == before.keys() and all(type(v) is torch.Tensor and torch.equal(v, before[k])
                                                 for k, v in after.items())
