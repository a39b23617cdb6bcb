"""The attention kernel choice of ``parallelize(schedule="auto")`` on the CPU, with fake sweeps and refusals:
the chooser's reasons, world 1 keeping torch SDPA unless FA4 measured faster, the design test at the chosen
kernel's measured speed at world > 1, the sweep running for real while Dynamo traces, the first rank's
failure raised on every rank, and the choice in the handle and the server's report."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from xstage_dit.calibration.kernel_sweep import KernelSweep
from xstage_dit.ops.attention.auto import resolve_attention_decision
from xstage_dit.ops.attention.window_path import problem_family, problem_refusals
from xstage_dit.features.attention_kernels import KernelChooser
from xstage_dit.features.attention_schedules import AttentionSchedules
from xstage_dit.schedule.attention_kernel import KernelChoice
from xstage_dit.schedule.facts import DeviceFacts
from xstage_dit.xstage import XStageParams

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
H200 = DeviceFacts(name="NVIDIA H200", num_sms=132, l2_bytes=60 << 20, compute_capability=(9, 0), is_cuda=True)
WAN = dict(batch=1, seq_len=32760, heads=40, head_dim=128, dtype=torch.bfloat16)


class FakeSweep:
    """A sweep that returns ``timings`` for every family asked (None: nothing cached) and records the calls."""

    def __init__(self, timings=None, fail=None):
        self.timings, self.fail, self.calls = timings, fail, []

    def __call__(self, problem, family, measure):
        self.calls.append((family, measure))
        if self.fail:
            raise RuntimeError(self.fail)
        if self.timings is None:
            return None
        return KernelSweep({}, {family: dict(self.timings)}, "fake", path="/fake/kernel-sweep.json")


def takes(*names, refuse=()):
    """Fake refusals: the named candidates take every problem, the ``refuse`` ones say why not."""
    def refusals(**problem):
        return {**{n: None for n in names}, **{n: f"{n} refuses (test)" for n in refuse}}
    return refusals


def chooser(world, sweep, refusals, allow_measure=True):
    return KernelChooser(world=world, allow_measure=allow_measure, sweep=sweep, refusals=refusals)


def test_world1_keeps_torch_sdpa_unless_fa4_measured_faster():
    shape = dict(WAN, device=CPU)
    # FA4 faster at this shape: FA4 plain, both times in the reason.
    k = chooser(1, FakeSweep({"sdpa": 9.0, "fa4": 8.2}), takes("sdpa", "fa4")).choose(**shape)
    assert (k.name, k.baseline_ms) == ("fa4", 9.0) and "fa4 8.200 ms" in k.reason and "sdpa 9.000 ms" in k.reason
    d = resolve_attention_decision(None, k, world_size=1, device=CPU, **WAN)
    assert d.name == "fused:fa4" and "world size 1" in d.reason and "1.098x torch SDPA" in d.reason
    # FA4 slower: torch SDPA, i.e. diffusers' own call ("serial").
    k = chooser(1, FakeSweep({"sdpa": 7.0, "fa4": 8.2}), takes("sdpa", "fa4")).choose(**shape)
    assert k.name == "sdpa"
    assert resolve_attention_decision(None, k, world_size=1, device=CPU, **WAN).name == "serial"
    # No sweep entry for the shape, or torch SDPA's timing failed: no kernel was shown faster, SDPA stays.
    for sweep in (FakeSweep(None), FakeSweep({"fa4": 1.0}), FakeSweep({"sdpa": None, "fa4": 1.0})):
        k = chooser(1, sweep, takes("sdpa", "fa4")).choose(**shape)
        assert k.name == "sdpa" and "sdpa not measured" in k.reason, (sweep.timings, k)
        assert sweep.calls  # it asked
    # FA4 refuses (no GPU, not installed): nothing to compare, the sweep is never asked.
    never = FakeSweep(fail="must not be called")
    k = chooser(1, never, takes("sdpa", refuse=("fa4",))).choose(**shape)
    assert k.name == "sdpa" and "only sdpa takes the shape" in k.reason and "fa4 refuses (test)" in k.reason
    assert never.calls == []


def test_world1_one_kernel_for_every_batch_size():
    """A batch of images attends with the kernel one image gets: the family timed is the one-image shape's."""
    class PerBatch(FakeSweep):  # a sweep whose timings would pick another kernel for batch 4
        def __call__(self, problem, family, measure):
            self.calls.append((family, measure))
            timings = {"sdpa": 9.0, "fa4": 8.0} if "-b1-" in family else {"sdpa": 7.0, "fa4": 8.0}
            return KernelSweep({}, {family: timings}, "fake")

    sweep = PerBatch()
    k1 = chooser(1, sweep, takes("sdpa", "fa4")).choose(**dict(WAN, device=CPU))
    k4 = chooser(1, sweep, takes("sdpa", "fa4")).choose(**dict(WAN, batch=4, device=CPU))
    assert k1.name == k4.name == "fa4" and all("-b1-" in family for family, _ in sweep.calls)
    # world > 1 keeps the batch in the family: the window kernels' geometry depends on it
    sweep4 = PerBatch()
    chooser(4, sweep4, takes("fa4", "triton")).choose(**dict(WAN, batch=2, device=CPU))
    assert all("-b2-" in family for family, _ in sweep4.calls)


def test_real_refusals_on_the_cpu_measure_nothing_and_choose_what_ran_before():
    never = FakeSweep(fail="must not be called")
    at1 = KernelChooser(world=1, allow_measure=True, sweep=never).choose(**WAN, device=CPU)
    assert at1.name == "sdpa" and "FA4 needs a CUDA device" in at1.refused["fa4"]
    assert "cuDNN SDPA needs a CUDA device" in at1.refused["cudnn"]
    at4 = KernelChooser(world=4, allow_measure=True, sweep=never).choose(**WAN, device=CPU)
    assert at4.name is None and set(at4.refused) == {"fa4", "fa4-gqa", "fa4-gqa-unpacked", "cudnn", "triton"}
    assert never.calls == []
    d = resolve_attention_decision(XStageParams.reference(), at4, world_size=4, device=CPU, facts=H200, **WAN)
    assert d.name == "serial" and "every kernel refuses" in d.reason and d.kernel is None
    assert problem_refusals(world_size=1, device=CPU, **WAN)["sdpa"] is None


def test_world4_design_test_runs_at_the_kernels_measured_speed():
    ref = XStageParams.reference()
    fast = chooser(4, FakeSweep({"sdpa": 1.00, "fa4": 0.90, "cudnn": 0.80, "triton": 1.20}),
                   takes("fa4", "triton", refuse=("cudnn",))).choose(**WAN, device=CPU)
    # cudnn's stale timing is faster, but it refuses the shape; sdpa is the reference, never a window kernel.
    assert fast.name == "fa4" and fast.refused == {"cudnn": "cudnn refuses (test)"} and "sdpa" not in fast.timings_ms
    d = resolve_attention_decision(ref, fast, world_size=4, device=torch.device("cuda"), facts=H200, **WAN)
    assert d.name == "fused:fa4" and "design test holds" in d.reason and "fa4 measured 1.111x torch SDPA" in d.reason
    assert d.kernel == "fa4" and "fastest measured" in d.kernel_reason and d.baseline_ms == 1.0
    # The same kernel at half of torch SDPA's speed: its slower attention costs more than the A2A it hides.
    slow = KernelChoice("fa4", "test", {"fa4": 2.0}, {}, baseline_ms=1.0)
    d = resolve_attention_decision(ref, slow, world_size=4, device=torch.device("cuda"), facts=H200, **WAN)
    assert d.name == "serial" and "costs more than the All-to-All" in d.reason
    # Not measured: the design test at the assumed speed (our Triton kernel's 0.88x, as before the sweep), which
    # at the reference drain rate loses to the serial path; said so. No params: serial.
    unmeasured = KernelChoice("triton", "not measured", {}, {})
    d = resolve_attention_decision(ref, unmeasured, world_size=4, device=torch.device("cuda"), facts=H200, **WAN)
    assert d.name == "serial" and "not measured: assumed 0.88x" in d.reason and d.kernel == "triton"
    d = resolve_attention_decision(None, fast, world_size=4, device=torch.device("cuda"), facts=H200, **WAN)
    assert d.name == "serial" and "no X-Stage calibration" in d.reason and d.kernel == "fa4"


def test_under_cuda_graphs_the_chooser_refuses_what_a_capture_broke():
    """`apply_compile(mode="graphs")` records the forward in CUDA graphs, where cudnn-frontend's window graph failed
    (H200, b3a1445): the chooser then refuses it at world > 1 with the reason, and takes it again after the undo;
    at world 1 ("cudnn" there is torch's own cuDNN SDPA backend) nothing changes."""
    timings = {"sdpa": 1.00, "fa4": 0.90, "cudnn": 0.80, "triton": 1.20}
    c = chooser(4, FakeSweep(timings), takes("fa4", "cudnn", "triton"))
    assert c.choose(**WAN, device=CPU).name == "cudnn"
    undo = c.for_cuda_graphs()
    other = dict(WAN, seq_len=8192)  # a shape not chosen yet
    under_graphs = c.choose(**other, device=CPU)
    assert under_graphs.name == "fa4" and "CUDA-graph" in under_graphs.refused["cudnn"]
    undo()
    assert c.choose(**other, device=CPU).name == "cudnn"
    one = chooser(1, FakeSweep({"sdpa": 1.0, "fa4": 0.9, "cudnn": 0.8}), takes("sdpa", "fa4", "cudnn"))
    one.for_cuda_graphs()
    assert one.choose(**WAN, device=CPU).name == "cudnn"


def test_compile_graphs_arms_the_chooser_of_a_parallelized_pipeline():
    from xstage_dit.families import load_pipeline
    from xstage_dit.features import ParallelConfig, parallelize
    from xstage_dit.features.compile import apply_compile

    pipe = load_pipeline("tiny-flux", dtype=torch.float32, device=CPU, seed=0)
    handle = parallelize(pipe, ParallelConfig(schedule="auto", calibrate=False))
    handle.attention_kernels.world = 2  # as a rank of two would have it (one process here): arming is per world
    try:
        compiled = apply_compile(pipe, "graphs", backend="eager")
        assert "cudnn" in handle.attention_kernels.capture_refusals
        compiled.restore()
        assert handle.attention_kernels.capture_refusals == {}
        compiled = apply_compile(pipe, "full", backend="eager")
        assert handle.attention_kernels.capture_refusals == {}
        compiled.restore()
    finally:
        handle.restore()


def test_a_family_is_swept_once_and_failures_leave_it_unmeasured(caplog):
    sweep = FakeSweep({"sdpa": 2.0, "fa4": 1.0})
    c = chooser(1, sweep, takes("sdpa", "fa4"), allow_measure=False)
    c.choose(**dict(WAN, seq_len=32768), device=CPU)
    c.choose(**WAN, device=CPU)  # same family (S bucket 32K): read from memory
    family = problem_family(world_size=1, **WAN)
    assert sweep.calls == [(family, False)]  # calibrate=False: the cache only
    assert c.report()["families"][family] == {"timings_ms": {"sdpa": 2.0, "fa4": 1.0}, "source": "fake",
                                              "path": "/fake/kernel-sweep.json"}
    broken = chooser(1, FakeSweep(fail="out of memory"), takes("sdpa", "fa4"))
    with caplog.at_level(logging.WARNING, logger="xstage_dit.features.attention_kernels"):
        k = broken.choose(**WAN, device=CPU)
    assert k.name == "sdpa" and "out of memory" in broken.report()["errors"][family]
    assert any("kernel sweep for" in r.getMessage() and "out of memory" in r.getMessage() for r in caplog.records)


def test_trace_time_decision_measures_on_real_tensors_and_agrees_with_eager():
    """Dynamo calls the assume_constant_result decision for real while tracing: the sweep's closures see real
    tensors and no dispatch mode, so a sweep can launch real kernels there; the compiled graph bakes the name."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    seen = []

    def real_sweep(problem, family, measure):
        x = torch.randn(64, 64)
        y = x @ x  # a real kernel
        seen.append((type(y) is torch.Tensor and not isinstance(y, FakeTensor), _get_current_dispatch_mode_stack(),
                     torch.compiler.is_compiling(), float(y.abs().sum()) > 0))
        return KernelSweep({}, {family: {"sdpa": 2.0, "fa4": 1.0}}, "measured")

    def make():
        return AttentionSchedules("auto", world=1, facts=DeviceFacts.cpu(),
                                  kernels=chooser(1, real_sweep, takes("sdpa", "fa4")))

    def f(x, book):
        name = book.for_shape(1, 64, 4, 16, torch.bfloat16, CPU)
        return x * 2 if name == "fused:fa4" else x * 3

    torch._dynamo.reset()
    compiled_book = make()
    try:
        out = torch.compile(f, backend="eager", fullgraph=True)(torch.ones(4), compiled_book)
    finally:
        torch._dynamo.reset()
    assert seen == [(True, [], True, True)]  # measured once, while tracing, on real tensors
    assert torch.equal(out, torch.full((4,), 2.0))
    eager_book = make()
    assert f(torch.ones(4), eager_book).tolist() == [2.0] * 4 and seen[-1][2] is False
    assert {k: v.name for k, v in compiled_book.choices.items()} == {k: v.name for k, v in eager_book.choices.items()}


@pytest.fixture
def one_rank_gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_the_first_ranks_choice_is_broadcast_and_its_failure_raised(one_rank_gloo):
    sweep = FakeSweep({"sdpa": 1.0, "fa4": 0.9, "triton": 1.5})
    c = KernelChooser(world=2, group=one_rank_gloo, allow_measure=True, sweep=sweep, refusals=takes("fa4", "triton"))
    assert c.collective
    assert c.choose(**WAN, device=CPU).name == "fa4"

    def boom(**problem):
        raise KeyError("no such kernel table")

    bad = KernelChooser(world=2, group=one_rank_gloo, allow_measure=True, sweep=sweep, refusals=boom)
    with pytest.raises(RuntimeError, match="first rank: KeyError: 'no such kernel table'"):
        bad.choose(**WAN, device=CPU)


def _tiny_flux():
    sys.path.insert(0, str(ROOT / "tests" / "features"))
    import _parallelize_worker as worker

    return worker._flux(heads=2)


def test_parallelize_records_both_reasons_and_the_report_shows_them(monkeypatch, caplog):
    import xstage_dit.features.attention_kernels as ak
    from xstage_dit.features import ParallelConfig, parallelize
    from xstage_dit.server.startup import kernel_report, schedule_report

    sweep = FakeSweep({"sdpa": 1.0, "fa4": 1.3})
    # The machine's candidates and timings, faked: FA4 takes the shape but measured slower than torch SDPA.
    monkeypatch.setattr(ak, "problem_refusals", takes("sdpa", "fa4"))
    monkeypatch.setattr(ak.KernelChooser, "_machine_sweep", lambda self, *a: sweep(*a))
    pipe = _tiny_flux()
    pipe.set_progress_bar_config(disable=True)
    with caplog.at_level(logging.INFO, logger="xstage_dit.features.attention_schedules"):
        with parallelize(pipe, ParallelConfig(calibrate=True)) as handle:
            pipe(prompt="a fox", height=32, width=32, num_inference_steps=1, max_sequence_length=8,
                 generator=torch.Generator().manual_seed(0), output_type="np")
            schedules, kernels = schedule_report(handle), kernel_report(handle)
    (key, decision), = handle.schedule_choices.items()
    assert decision.name == "serial" and decision.kernel == "sdpa" and "world size 1" in decision.reason
    assert "fastest measured on this machine: sdpa 1.000 ms (vs fa4 1.300 ms)" == decision.kernel_reason
    assert sweep.calls == [(problem_family(batch=key[0], seq_len=key[1], heads=key[2], head_dim=key[3],
                                           world_size=1, dtype=key[4]), True)]
    lines = [r.getMessage() for r in caplog.records if "attention schedule for" in r.getMessage()]
    assert len(lines) == 1 and "kernel sdpa (fastest measured" in lines[0] and "world size 1" in lines[0]
    # /v1/calibration's sections (JSON): per shape both reasons and the timings; the sweep's families.
    (shown,) = schedules.values()
    assert shown["name"] == "serial" and shown["kernel"] == "sdpa" and shown["timings_ms"] == {"sdpa": 1.0, "fa4": 1.3}
    assert shown["kernel_reason"] == decision.kernel_reason and shown["reason"] == decision.reason
    assert list(kernels["families"].values()) == [{"timings_ms": {"sdpa": 1.0, "fa4": 1.3}, "source": "fake",
                                                   "path": "/fake/kernel-sweep.json"}]
    with parallelize(pipe, ParallelConfig(schedule="serial")) as fixed:
        assert fixed.attention_kernels is None and "no kernel sweep" in kernel_report(fixed)["note"]
