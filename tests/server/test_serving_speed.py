"""The server's step path does no per-step synchronization and no blocking control round trip, and all
ranks stop a cancelled batch at the same step. A fake pipeline on a fake GPU (events complete two steps
after they are recorded) runs through the real `BatchRunner` and `Worker._run_batch`; every
synchronization torch offers is counted."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from xstage_dit.runtime.generation import GenerationRequest
from xstage_dit.server import worker as worker_module
from xstage_dit.server.config import ServedModel, ServerConfig
from xstage_dit.server.control import StopVote
from xstage_dit.server.runner import BatchRunner, BatchStopped, StepClock
from xstage_dit.server.ranks import RankContext
from xstage_dit.server.worker import Worker

LAG = 2  # steps the fake GPU runs behind the host


class FakeGPU:
    def __init__(self):
        self.launched = 0
        self.finished = 0
        self.syncs = 0

    def step(self):
        self.decoded = False
        self.launched += 1
        self.finished = max(self.finished, self.launched - LAG)

    def drain(self):
        self.finished = self.launched
        self.decoded = True  # the VAE decode ran: a vote started at the last step has long arrived


class FakeEvent:
    gpu: FakeGPU

    def __init__(self, enable_timing=False):
        self.mark = None

    def record(self, stream=None):
        self.mark = self.gpu.launched

    def query(self):
        return self.gpu.finished >= self.mark

    def synchronize(self):
        self.gpu.syncs += 1
        self.gpu.finished = max(self.gpu.finished, self.mark)

    def elapsed_time(self, end):
        assert self.query() and end.query(), "elapsed_time of an event not complete: that waits for the GPU"
        return 10.0 * (end.mark - self.mark)


class FakePipe:
    device = torch.device("cuda")

    def __init__(self, gpu):
        self.gpu = gpu

    def __call__(self, prompt, height, width, num_inference_steps, guidance_scale, generator, output_type,
                 callback_on_step_end=None):
        n = len(prompt) if isinstance(prompt, list) else 1
        for i in range(num_inference_steps):
            self.gpu.step()
            callback_on_step_end(self, i, None, {})
        self.gpu.drain()  # decoding to numpy waits for the GPU once, at the end
        return SimpleNamespace(images=np.zeros((n, 8, 8, 3), np.float32))


class FakeWork:
    """A gloo Work that completes once the host has moved on by one step (or the pipeline has decoded)."""

    def __init__(self, tensor, gpu, peers_flag, log):
        self.tensor, self.gpu, self.started, self.log = tensor, gpu, gpu.launched, log
        tensor[0] = max(int(tensor.numpy()[0]), peers_flag)

    def wait(self):
        ready = self.gpu.launched > self.started or self.gpu.decoded
        self.log.append("ready" if ready else "blocking")


SERVED = ServedModel(name="fake", kind="image", size_multiple=8, default_width=8, default_height=8,
                     default_steps=8, default_guidance=0.0)


@pytest.fixture
def gpu(monkeypatch):
    gpu = FakeGPU()
    FakeEvent.gpu = gpu
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    counts = {"cuda.synchronize": 0, "Tensor.item": 0, "Tensor.tolist": 0, "Tensor.cpu": 0}

    def counting(name, original=None):
        def call(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs) if original else None
        return call

    monkeypatch.setattr(torch.cuda, "synchronize", counting("cuda.synchronize"))
    monkeypatch.setattr(torch.Tensor, "item", counting("Tensor.item", torch.Tensor.item))
    monkeypatch.setattr(torch.Tensor, "tolist", counting("Tensor.tolist", torch.Tensor.tolist))
    monkeypatch.setattr(torch.Tensor, "cpu", counting("Tensor.cpu", torch.Tensor.cpu))
    gpu.counts = counts
    return gpu


def _worker(monkeypatch, gpu, world_size, peers_flag=0, period=1):
    log: list[str] = []
    monkeypatch.setattr(worker_module, "reducer",
                        lambda group: (lambda tensor: FakeWork(tensor, gpu, peers_flag, log)))
    w = Worker(lambda ctx: None, ServerConfig(stop_check_steps=period, api_key=None))
    w.ctx = RankContext(rank=0, world_size=world_size, control_group=object())
    return w, log


def _item(steps=8, n=1):
    return GenerationRequest(kind="image", prompt="p", width=8, height=8, steps=steps, guidance=0.0, n=n)


@pytest.mark.parametrize("world_size", [1, 2])
def test_no_step_waits_for_the_gpu_or_the_control_channel(monkeypatch, gpu, world_size):
    w, votes = _worker(monkeypatch, gpu, world_size)
    seen = []

    def decide(done, total, gpu_done, step_times):
        seen.append((done, gpu_done, list(step_times)))
        return True

    result = w._run_batch(BatchRunner(FakePipe(gpu), SERVED), [_item()], False, decide)
    assert gpu.syncs == 0 and gpu.counts == {k: 0 for k in gpu.counts}, (gpu.syncs, gpu.counts)
    # Progress trails the host by the GPU's lag: it is read from completed events, never waited for.
    assert [d for d, _, _ in seen] == list(range(1, 9))
    assert [g for _, g, _ in seen] == [max(0, d - LAG) for d in range(1, 9)]
    assert result.step_times == [0.01] * 7  # every step after the first, in seconds, once all completed
    if world_size == 1:
        assert votes == []
    else:
        assert len(votes) == 8 and "blocking" not in votes, votes  # 7 reads one step late + the final one


def test_all_ranks_stop_one_vote_after_rank0_decides(monkeypatch, gpu):
    w, votes = _worker(monkeypatch, gpu, 2)
    with pytest.raises(BatchStopped) as stopped:
        w._run_batch(BatchRunner(FakePipe(gpu), SERVED), [_item()], False, lambda done, *_: done < 3)
    assert stopped.value.steps_done == 4 and "blocking" not in votes
    # A follower (no decide) stops at the same step when rank 0's flag arrives through the reduction.
    w2, votes2 = _worker(monkeypatch, gpu, 2, peers_flag=1)
    with pytest.raises(BatchStopped) as follower:
        w2._run_batch(BatchRunner(FakePipe(gpu), SERVED), [_item()], False, None)
    assert follower.value.steps_done == 2  # the first vote (step 1) carried the flag, read at step 2


def test_world1_cancel_stops_at_the_next_step(monkeypatch, gpu):
    w, _ = _worker(monkeypatch, gpu, 1)
    with pytest.raises(BatchStopped) as stopped:
        w._run_batch(BatchRunner(FakePipe(gpu), SERVED), [_item()], False, lambda done, *_: done < 3)
    assert stopped.value.steps_done == 3


class SpyPipe(FakePipe):
    def __init__(self, gpu):
        super().__init__(gpu)
        self.seeds = []

    def __call__(self, prompt, height, width, num_inference_steps, guidance_scale, generator, output_type,
                 callback_on_step_end=None):
        gens = generator if isinstance(generator, list) else [generator]
        self.seeds.append([g.initial_seed() for g in gens])
        return super().__call__(prompt, height, width, num_inference_steps, guidance_scale, generator, output_type,
                                callback_on_step_end)


@pytest.mark.parametrize("one_at_a_time, calls", [(False, [[5, 6, 7]]), (True, [[5], [6], [7]])])
def test_one_image_at_a_time_runs_a_call_per_image(gpu, one_at_a_time, calls):
    pipe = SpyPipe(gpu)
    out = BatchRunner(pipe, SERVED).run([_item(steps=2, n=3).__class__(**{**_item(steps=2, n=3).__dict__, "seed": 5})],
                                        lambda *_: True, one_at_a_time)
    assert out.pixels.shape == (3, 8, 8, 3) and pipe.seeds == calls


def test_stop_vote_rejects_a_bad_period():
    with pytest.raises(ValueError, match="expected a stop-vote period of >= 1 steps, got 0"):
        StopVote(lambda t: None, period=0)


def test_step_clock_on_the_cpu_reports_host_intervals():
    clock = StepClock("cpu")
    clock.mark()
    assert clock.poll() == [] and clock.completed == 1
    clock.mark()
    times = clock.poll()
    assert len(times) == 1 and times[0] >= 0 and clock.completed == 2
