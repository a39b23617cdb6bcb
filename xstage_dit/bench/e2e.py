#!/usr/bin/env python3
"""End-to-end latency on sample prompts: xstage_dit against what users run today (issue 8).

For one model and one GPU count, every prompt of ``xstage_dit/bench/prompts.txt`` runs through each
contender with the same seed, size and steps, after warm-up. Per contender it reports the end-to-end
latency (median, p90), the transformer time per denoising step (CUDA events around every transformer
forward, from forward pre/post hooks), the peak GPU memory (``torch.cuda.max_memory_allocated``, reset
per contender) and the speedup over plain diffusers on one GPU. Contenders share one loaded pipeline:
each is applied, measured and undone in turn, so a 12-14B parameter model is built once.

Drift: a GPU's clocks and temperature move over a run by more than the differences measured here. With
``--rounds N`` (N >= 2) the eager diffusers and xstage contenders are measured in N interleaved rounds (the
order rotated every round) and compared by paired ratios (same round, same prompt); with N = 1 plain diffusers
runs again after them (an A/B/A order). Each eager xstage row gets a verdict from a 95% interval of the paired
ratios: "slower" or "faster" only when the interval excludes 1, else "same within noise".

Writes ``<out-dir>/e2e-<model>-<gpus>x<gpu>.json`` (top-level ``summary``: per contender the median
latency in seconds and the speedup over plain diffusers on one GPU), ``.md`` (table) and ``.png``
(bar chart). The JSON and the table are rewritten after every contender, so a run cut short by a
time limit still leaves what it measured.

Usage (the options are those of ``xstage-dit bench``; see ``--help``)::

    python xstage_dit/bench/e2e.py --model tiny-flux --num-prompts 1 --steps 2          # CPU smoke run
    python xstage_dit/bench/e2e.py --model full-flux --num-prompts 3 --compile          # one H200
    torchrun --nproc-per-node 4 xstage_dit/bench/e2e.py --model full-flux --gpus 4      # four GPUs
    python xstage_dit/bench/e2e.py --model full-flux --gpus 4     # the same: starts its 4 ranks itself
    python xstage_dit/bench/e2e.py --model full-nucleusmoe --steps 4 --rounds 4           # drift-robust
    python xstage_dit/bench/e2e.py --rerender benchmarks/results/e2e-full-flux-1xh200.json   # no measuring

``benchmarks/run_e2e_gpu.sh`` runs the three models of issue 8 on a GPU machine in one budgeted call.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import math
import os
import re
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
# The checkout's xstage_dit and benchmarks package first: xfuser's wheel installs a top-level
# `benchmarks` directory of its own into site-packages.
if sys.path[:1] != [str(REPO_ROOT)]:
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._common import environment, write_results  # noqa: E402
from xstage_dit.cli import bench as bench_cli  # noqa: E402
from xstage_dit.jsonable import to_jsonable  # noqa: E402

BASELINE = "diffusers"
# Our group: the baseline and the xstage contenders. Their eager variants are reversible (apply/restore leave
# the pipeline as it was), which is what lets --rounds measure them in interleaved rounds.
OUR_FAMILIES = ("diffusers", "xstage-serial", "xstage-calibrated")
XFUSER_PIN = "0.7.0"  # pyproject.toml, extra "bench"
# Families whose MoE layers get expert parallelism sharing the sequence-parallel ranks.
MOE_FAMILIES = ("nucleusmoe", "hidream")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ----------------------------------------------------------------------------------------------------
# Inputs


def load_prompts(path: str | Path, num_prompts: int | None = None) -> list[str]:
    """Prompts of a file, one per line; blank lines and lines starting with '#' are skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    prompts = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise ValueError(f"expected at least one prompt in {str(path)!r}, got none")
    if num_prompts is not None:
        if num_prompts > len(prompts):
            raise ValueError(f"expected --num-prompts <= {len(prompts)} (prompts in {path}), got {num_prompts}")
        prompts = prompts[:num_prompts]
    return prompts


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("expected at least one value, got none")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def gpu_label(device: torch.device) -> str:
    """Short lower-case GPU model for file names ('NVIDIA H200' -> 'h200'); 'cpu' without a GPU."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    words = [w for w in re.split(r"[\s_]+", name) if w and w.upper() not in ("NVIDIA", "TESLA", "GEFORCE")]
    return re.sub(r"[^a-z0-9.-]", "", (words[0] if words else name).lower()) or "gpu"


def model_slug(model: str) -> str:
    """A file-name-safe model name: the registry name, or a local folder's base name."""
    base = Path(model).name if (os.sep in model or Path(model).is_dir()) else model
    return re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-") or "model"


# ----------------------------------------------------------------------------------------------------
# Timing


class Stopwatch:
    """Elapsed seconds of a callable: CUDA events on a GPU (after a synchronize, so the span is what the
    user waits for), ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time(self, fn):
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3, out
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out


class TransformerTimer:
    """Times every forward of ``module`` with CUDA events (``perf_counter`` on the CPU) recorded from
    forward pre/post hooks; ``collect()`` returns (total seconds, forward calls) since the last collect."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.cuda = device.type == "cuda"
        self._spans: list = []
        self._open = None
        self._handles = [
            module.register_forward_pre_hook(self._before),
            module.register_forward_hook(self._after),
        ]

    def _stamp(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _before(self, module, args):
        self._open = self._stamp()

    def _after(self, module, args, output):
        if self._open is not None:
            self._spans.append((self._open, self._stamp()))
            self._open = None

    def collect(self) -> tuple[float, int]:
        spans, self._spans = self._spans, []
        if self.cuda:
            torch.cuda.synchronize()
            total = sum(a.elapsed_time(b) for a, b in spans) / 1e3
        else:
            total = sum(b - a for a, b in spans)
        return total, len(spans)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


# ----------------------------------------------------------------------------------------------------
# The run: one loaded pipeline, shared by every contender


@dataclasses.dataclass
class Bench:
    """Everything a contender needs: the pipeline, the settings, where this rank sits, the clock."""

    args: argparse.Namespace
    spec: object  # xstage_dit.models.ModelSpec
    pipe: object  # diffusers.DiffusionPipeline
    device: torch.device
    dtype: torch.dtype
    rank: int
    world_size: int
    prompts: list[str]
    steps: int
    height: int
    width: int
    frames: int
    t_start: float
    build_s: float = 0.0
    eager_transformer: torch.nn.Module | None = None
    compiled_blocks: list = dataclasses.field(default_factory=list)
    # Which contender left the pipeline modified beyond undoing (None: pristine). A contender that does not
    # accept that state gets a freshly built pipeline first.
    dirty: str | None = None

    def rebuild(self) -> None:
        """Drop the pipeline and build it again (after a contender that cannot be undone)."""
        import gc

        from xstage_dit.models import load_pipeline

        self.pipe = None
        self.eager_transformer = None
        self.compiled_blocks = []
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        self.pipe = load_pipeline(self.args.model, dtype=self.dtype, device=self.device, seed=self.args.seed)
        self.pipe.set_progress_bar_config(disable=True)
        self.build_s = time.perf_counter() - t0
        self.dirty = None

    def call_kwargs(self, prompt: str, steps: int) -> dict:
        from xstage_dit.models.generation import call_kwargs

        return call_kwargs(self.pipe, self.spec, prompt=prompt, height=self.height, width=self.width,
                           frames=self.frames if self.spec.kind == "video" else None, steps=steps,
                           seed=self.args.seed)

    def seconds_left(self) -> float:
        if not self.args.time_budget_s:
            return math.inf
        return self.args.time_budget_s - (time.perf_counter() - self.t_start)

    def compile_transformer(self) -> str:
        """``torch.compile`` the current transformer; returns how.

        regional: diffusers' ``compile_repeated_blocks`` (each repeated transformer block compiled once
        and reused: what diffusers recommends, and a fraction of the compile time); full: the whole
        module (``--compile-mode full``, or a model without ``_repeated_blocks``).
        """
        transformer = self.pipe.transformer
        if self.args.compile_mode == "regional" and getattr(transformer, "_repeated_blocks", None):
            transformer.compile_repeated_blocks()
            self.compiled_blocks = [m for m in transformer.modules() if "_compiled_call_impl" in vars(m)]
            return "regional (compile_repeated_blocks)"
        self.eager_transformer = transformer
        self.pipe.transformer = torch.compile(transformer)
        return "full module"

    def uncompile(self) -> None:
        if self.eager_transformer is None and not self.compiled_blocks:
            return
        if self.eager_transformer is not None:
            self.pipe.transformer = self.eager_transformer
            self.eager_transformer = None
        for module in self.compiled_blocks:
            # nn.Module.compile() sets this instance attribute; without it the class default (None) runs eager.
            vars(module).pop("_compiled_call_impl", None)
        self.compiled_blocks = []
        torch._dynamo.reset()  # compiled graphs hold on to the patched modules and their buffers

    def ensure_process_group(self) -> None:
        """A process group for contenders that need one: torchrun's, or a group of one on this machine."""
        if dist.is_initialized():
            return
        if self.world_size > 1:
            raise RuntimeError(f"expected the process group of the {self.world_size} launched ranks, found none")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)
        dist.init_process_group(backend="nccl" if self.device.type == "cuda" else "gloo", rank=0, world_size=1)


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= 400 else text[:397] + "..."


# ----------------------------------------------------------------------------------------------------
# Contenders: check (reason it cannot run, detected before any GPU work), apply, call, restore


class Contender:
    family = ""
    irreversible = False  # no way to undo it: runs after every reversible contender, marks the pipeline dirty

    def __init__(self, compile: bool):
        self.compile = compile
        self.info: dict = {}

    def accepts(self, dirty: str | None) -> bool:
        """Whether this contender can run on a pipeline left modified by ``dirty`` (None: pristine)."""
        return dirty is None

    @property
    def name(self) -> str:
        return self.family + ("+compile" if self.compile else "")

    def check(self, b: Bench) -> str | None:
        return None

    def apply(self, b: Bench) -> None:
        if self.compile:
            self.info["compile_mode"] = b.compile_transformer()

    def call(self, b: Bench, kwargs: dict):
        return b.pipe(**kwargs)

    def restore(self, b: Bench) -> None:
        b.uncompile()


class PlainDiffusers(Contender):
    """The unmodified diffusers pipeline; at a GPU count > 1 every rank runs it alone on its GPU."""

    family = "diffusers"


class PlainDiffusersRepeat(PlainDiffusers):
    """Plain diffusers again, after the eager xstage contenders (an A/B/A order, at ``--rounds 1``): the
    baseline's own drift over the run (clocks, temperature) shows, and the xstage rows pair with both runs."""

    family = "diffusers-repeat"


class XStage(Contender):
    """``xstage_dit.parallelize`` with the serial schedule, or with the calibrated ones."""

    def __init__(self, compile: bool, schedule: str):
        super().__init__(compile)
        self.schedule = schedule
        self.family = "xstage-serial" if schedule == "serial" else "xstage-calibrated"
        self.handle = None

    def _config(self, b: Bench):
        from xstage_dit.patches import ParallelConfig

        ep = b.world_size if b.spec.family in MOE_FAMILIES else 1
        if self.schedule == "serial":
            return ParallelConfig(sp=b.world_size, ep=ep, cfg=1, schedule="serial", calibrate=False)
        return ParallelConfig(sp=b.world_size, ep=ep, cfg=1, schedule="auto", calibrate=True)

    def check(self, b: Bench) -> str | None:
        try:
            from xstage_dit.patches import parallelize  # noqa: F401
        except Exception as exc:  # not merged yet, or broken: say so instead of omitting the row
            return f"xstage_dit.patches does not import: {_error(exc)}"
        try:
            self.info["parallel_config"] = to_jsonable(self._config(b))
        except Exception as exc:
            return f"ParallelConfig refuses this configuration: {_error(exc)}"
        return None

    def apply(self, b: Bench) -> None:
        from xstage_dit.patches import parallelize

        self.handle = parallelize(b.pipe, self._config(b))
        calibration = getattr(self.handle, "calibration", None)
        self.info["calibration"] = None if calibration is None else {
            "source": getattr(calibration, "source", None),
            "machine_key": getattr(calibration, "machine_key", None),
            "params": to_jsonable(getattr(calibration, "params", None)),
        }
        super().apply(b)

    def restore(self, b: Bench) -> None:
        super().restore(b)
        handle, self.handle = self.handle, None
        if handle is None:
            return
        # The attention schedule per distinct layer shape, filled as the shapes were first seen.
        self.info["schedules"] = to_jsonable(getattr(handle, "schedule_choices", None))
        handle.restore()


class XFuserUSP(Contender):
    """xDiT/xfuser's USP: its pipeline wrapper with Ulysses degree = GPU count (ring degree 1)."""

    family = "xfuser-usp"

    def __init__(self, compile: bool, world_size: int):
        super().__init__(compile)
        # At degree > 1 the wrapper replaces attention layers inside the transformer: no way back.
        self.irreversible = world_size > 1
        self.wrapper = None
        self.saved: dict = {}
        self.had_forward_attr = False

    def check(self, b: Bench) -> str | None:
        version = _version("xfuser")
        if version is None:
            return f"xfuser is not installed (the bench extra pins xfuser=={XFUSER_PIN})"
        self.info["xfuser_version"] = version
        try:
            import xfuser  # noqa: F401
            from xfuser.model_executor.pipelines.register import xFuserPipelineWrapperRegister
        except Exception as exc:
            return f"xfuser {version} does not import here: {_error(exc)}"
        try:
            self.wrapper_class = xFuserPipelineWrapperRegister.get_class(b.pipe)
        except Exception as exc:
            return f"xfuser {version} has no pipeline wrapper for {type(b.pipe).__name__}: {_error(exc)}"
        return None

    def apply(self, b: Bench) -> None:
        from xfuser import xFuserArgs
        from xfuser.core.distributed import init_distributed_environment

        b.ensure_process_group()
        init_distributed_environment(rank=b.rank, world_size=b.world_size)  # adopts the existing group
        engine_config, _ = xFuserArgs(
            model=b.args.model, ulysses_degree=b.world_size, ring_degree=1, use_torch_compile=self.compile,
            height=b.height, width=b.width, num_inference_steps=b.steps, seed=b.args.seed,
        ).create_config()
        # The wrapper swaps the pipeline's transformer/scheduler/vae for its own: keep them to put back.
        self.saved = {name: getattr(b.pipe, name) for name in ("transformer", "scheduler", "vae")
                      if getattr(b.pipe, name, None) is not None}
        # With use_torch_compile it sets a compiled `forward` on the transformer instance itself.
        self.had_forward_attr = "forward" in vars(b.pipe.transformer)
        self.wrapper = self.wrapper_class(b.pipe, engine_config)
        if self.compile:
            self.info["compile_mode"] = "xfuser use_torch_compile (torch.compile of the transformer's forward)"
        naive = getattr(self.wrapper, "use_naive_forward", None)
        if callable(naive):
            # At degree 1 xfuser runs the unmodified diffusers pipeline: record it, the table says so.
            self.info["xfuser_naive_forward"] = bool(naive())

    def call(self, b: Bench, kwargs: dict):
        return self.wrapper(**kwargs)

    def restore(self, b: Bench) -> None:
        for name, module in self.saved.items():
            setattr(b.pipe, name, module)
        transformer = self.saved.get("transformer")
        if transformer is not None and not self.had_forward_attr and "forward" in vars(transformer):
            del transformer.forward
        self.saved, self.wrapper = {}, None
        if self.compile:
            torch._dynamo.reset()
        if self.irreversible:
            b.dirty = self.family


class DiffusersCP(Contender):
    """diffusers' native context parallelism (Ulysses) through ``enable_parallelism``."""

    family = "diffusers-cp"
    irreversible = True

    def accepts(self, dirty: str | None) -> bool:
        return dirty in (None, self.family)  # the compiled variant reuses the eager variant's sharding

    def check(self, b: Bench) -> str | None:
        import diffusers

        transformer = b.pipe.transformer
        if torch.accelerator.device_count() == 0:
            # enable_parallelism places rank r on accelerator r % device_count (a ZeroDivisionError here).
            return f"diffusers {diffusers.__version__} context parallelism needs an accelerator, found none"
        if getattr(transformer, "_cp_plan", None) is None:
            return f"{type(transformer).__name__} ships no _cp_plan in diffusers {diffusers.__version__}"
        try:
            from diffusers import ContextParallelConfig

            ContextParallelConfig(ulysses_degree=b.world_size)
        except Exception as exc:
            return (f"diffusers {diffusers.__version__} ContextParallelConfig(ulysses_degree={b.world_size}) "
                    f"refuses: {_error(exc)}")
        return None

    def apply(self, b: Bench) -> None:
        if b.dirty != self.family:
            from diffusers import ContextParallelConfig

            b.ensure_process_group()
            b.dirty = self.family  # from here on, even if enabling fails half-way
            b.pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=b.world_size))
        super().apply(b)


def make_contenders(names: list[str], with_compile: bool, world_size: int = 1, rounds: int = 1) -> list[Contender]:
    """Run order: diffusers and xstage eager (the baseline leading), then their compiled variants, then
    the other reversible stacks, then each irreversible contender with its compiled variant (they leave
    the pipeline modified). With ``rounds`` >= 2 the eager group is interleaved instead, so no
    diffusers-repeat."""
    factories = {
        "diffusers": lambda c: PlainDiffusers(c),
        "xstage-serial": lambda c: XStage(c, "serial"),
        "xstage-calibrated": lambda c: XStage(c, "auto"),
        "xfuser-usp": lambda c: XFuserUSP(c, world_size),
        "diffusers-cp": lambda c: DiffusersCP(c),
    }
    eager = [factories[n](False) for n in names]
    compiled = [factories[n](True) for n in names]
    # Other stacks after ours: importing xfuser patches modules and global state, so it must not run
    # before a diffusers/xstage measurement.
    ours = [c for c in eager + compiled if c.family in OUR_FAMILIES]
    if rounds == 1 and "diffusers" in names and any(n.startswith("xstage") for n in names):
        # The baseline once more right after the eager xstage contenders (A/B/A): its drift bounds the noise.
        last_eager = max(i for i, c in enumerate(ours) if not c.compile)
        ours.insert(last_eager + 1, PlainDiffusersRepeat(False))
    ordered = ours + [c for c in eager + compiled if c not in ours and not c.irreversible]
    for e, c in zip(eager, compiled):
        if e.irreversible and e not in ordered:
            ordered += [e, c]
    if not with_compile:
        for c in compiled:
            c.info["skip_reason"] = "torch.compile variants not requested (--compile)"
    return ordered


# ----------------------------------------------------------------------------------------------------
# Measuring one contender


def _output_array(output) -> np.ndarray | None:
    """The first sample of a pipeline output as float32 pixels, to compare contenders' results."""
    if output is None:
        return None
    data = getattr(output, "frames", None)
    if data is None:
        data = getattr(output, "images", None)
    if data is None:
        return None
    return np.asarray(data[0], dtype=np.float32)


def _agree(b: Bench, value):
    """Rank 0's value on every rank, so all ranks take the same skip/run decisions."""
    if b.world_size == 1 or not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def estimate_cost_s(b: Bench, contender: Contender, measured: dict | None, rounds: int = 1) -> float | None:
    """Seconds ``rounds`` rounds of a contender should take (each round: its warm-up and one run per prompt),
    from a measured row (the eager baseline's, or the contender's own), plus the assumed compile time and a
    rebuild of the pipeline when it needs a pristine one (both paid once)."""
    if measured is None or measured.get("status") != "ok":
        return None
    cost = rounds * (measured["warmup_s"] + measured["median_s"] * len(b.prompts))
    if contender.compile:
        cost += b.args.compile_estimate_s
    if not contender.accepts(b.dirty):
        cost += b.build_s
    return cost


def _row(contender: Contender, status: str, reason: str | None = None) -> dict:
    """A result row: flat headline fields (the table's columns) first, details after."""
    row = {"name": contender.name, "family": contender.family, "compile": contender.compile, "status": status}
    if reason is not None:
        row["reason"] = reason
    return row


def _info_fields(contender: Contender) -> dict:
    """What a contender recorded about itself (schedules, versions, compile mode), as row fields."""
    return {k: v for k, v in contender.info.items() if k != "skip_reason"}


@dataclasses.dataclass
class RoundResult:
    """One round of one contender: applied, warmed up, one timed run per prompt (in prompt order), undone."""

    latencies_s: list[float]
    step_s: list[float]  # transformer seconds per denoising step, per prompt
    forwards: list[int]  # transformer forwards of the run, per prompt
    setup_s: float
    warmup_s: float
    peak_memory_gib: float | None  # None on the CPU
    first_output: np.ndarray | None  # the first prompt's output, to compare contenders' results


def measure_round(b: Bench, contender: Contender) -> tuple[RoundResult | None, dict]:
    """Apply, warm up, time every prompt, undo.

    Returns the round (None when it failed) and what went wrong as row fields: ``reason`` and ``traceback``
    of a failure, ``restore_error`` when undoing failed (the pipeline is then marked dirty, so the next
    contender gets a freshly built one).
    """
    stopwatch = Stopwatch(b.device)
    problems: dict = {}
    result = None
    timer = None
    applied = False
    try:
        t0 = time.perf_counter()
        applied = True  # a half-applied contender is undone too: every restore() tolerates that
        contender.apply(b)
        setup_s = time.perf_counter() - t0
        if b.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(b.device)
        timer = TransformerTimer(b.pipe.transformer, b.device)
        warmup_steps = min(b.args.warmup_steps, b.steps)
        t0 = time.perf_counter()
        for _ in range(b.args.warmup):
            contender.call(b, b.call_kwargs(b.prompts[0], warmup_steps))
        if b.device.type == "cuda":
            torch.cuda.synchronize()
        warmup_s = time.perf_counter() - t0
        timer.collect()
        latencies, step_times, forwards = [], [], []
        first_output = None
        for i, prompt in enumerate(b.prompts):
            latency, output = stopwatch.time(lambda: contender.call(b, b.call_kwargs(prompt, b.steps)))
            transformer_s, calls = timer.collect()
            latencies.append(latency)
            step_times.append(transformer_s / b.steps)
            forwards.append(calls)
            if i == 0:
                first_output = _output_array(output)
        peak = torch.cuda.max_memory_allocated(b.device) / 2**30 if b.device.type == "cuda" else None
        result = RoundResult(latencies, step_times, forwards, setup_s, warmup_s, peak, first_output)
    except Exception as exc:
        problems.update(reason=_error(exc), traceback=traceback.format_exc(limit=8)[-4000:])
        if b.device.type == "cuda":
            torch.cuda.empty_cache()
    finally:
        if timer is not None:
            timer.remove()
        if applied:
            try:
                contender.restore(b)
            except Exception as exc:  # the next contender gets a freshly built pipeline instead
                problems["restore_error"] = _error(exc)
                b.dirty = f"{contender.name} (restore failed)"
    return result, problems


def rounds_row(contender: Contender, results: list[RoundResult], reference: np.ndarray | None, steps: int) -> dict:
    """The "ok" row of a contender measured in ``len(results)`` >= 1 rounds of ``steps`` denoising steps.

    Medians and p90 are over every (round, prompt) sample; ``latencies_s`` keeps the samples round by round,
    prompt by prompt (what ``paired_ratios`` pairs on); the peak memory is the highest of any round; set-up
    and warm-up times are round 1's (what the budget estimates from); the output is compared on round 1.
    """
    latencies = [t for r in results for t in r.latencies_s]
    step_s = [t for r in results for t in r.step_s]
    forwards = [n for r in results for n in r.forwards]
    peaks = [r.peak_memory_gib for r in results if r.peak_memory_gib is not None]
    row = _row(contender, "ok")
    row.update(
        median_s=statistics.median(latencies),
        p90_s=percentile(latencies, 90),
        transformer_step_ms=1e3 * statistics.median(step_s),
        peak_memory_gib=max(peaks) if peaks else None,
        latencies_s=latencies,
        rounds=len(results),
        round_medians_s=[statistics.median(r.latencies_s) for r in results],
        transformer_step_ms_all=[1e3 * t for t in step_s],
        transformer_forwards_per_step=statistics.median(forwards) / steps,
        setup_s=results[0].setup_s,
        warmup_s=results[0].warmup_s,
    )
    first = results[0].first_output
    if reference is not None and first is not None and first.shape == reference.shape:
        row["output_max_abs_diff_vs_diffusers"] = float(np.abs(first - reference).max())
    return row


def measure(b: Bench, contender: Contender, reference: np.ndarray | None) -> tuple[dict, np.ndarray | None]:
    """One round of a contender as its row (apply, warm up, time every prompt, undo). Returns the row and
    the first prompt's output."""
    result, problems = measure_round(b, contender)
    row = _row(contender, "failed") if result is None else rounds_row(contender, [result], reference, b.steps)
    row.update(problems)
    row.update(_info_fields(contender))
    return row, None if result is None else result.first_output


# ----------------------------------------------------------------------------------------------------
# The run order: each contender once, or the eager group in interleaved rounds


def precheck(b: Bench, contender: Contender, baseline_row: dict | None) -> tuple[str | None, str | None]:
    """(status, reason) of a contender that will not be measured ("skipped": not requested or no time left,
    "cannot run": what it detected), or (None, None); the same on every rank."""
    reason = contender.info.get("skip_reason")
    status = "skipped" if reason else None
    if status is None:
        reason = _agree(b, contender.check(b))
        status = "cannot run" if reason else None
    if status is None and contender.name != BASELINE:
        cost = estimate_cost_s(b, contender, baseline_row)
        left = b.seconds_left()
        if cost is not None and cost > left:
            status, reason = "skipped", f"time budget (needs ~{cost:.0f} s, {max(left, 0):.0f} s left)"
        status, reason = _agree(b, (status, reason))
    return status, reason


def unmeasured_row(contender: Contender, status: str, reason: str) -> dict:
    """The row of a contender that was not measured: its status, why, and what it recorded about itself."""
    row = _row(contender, status, reason)
    row.update(_info_fields(contender))
    return row


def prepare_pipeline(b: Bench, contender: Contender, settings: dict) -> None:
    """Build the pipeline again when the contender cannot run on what the previous one left behind."""
    if contender.accepts(b.dirty):
        return
    if b.rank == 0:
        print(f"[bench] rebuilding the pipeline (left modified by {b.dirty})", flush=True)
    b.rebuild()
    settings.setdefault("rebuilds_s", []).append(b.build_s)


class Report:
    """The rows so far, in run order, and where they go: rank 0 prints every change and rewrites the JSON
    and the table, so a run cut short by a time limit still leaves what it measured."""

    def __init__(self, b: Bench, settings: dict, env: dict, stem: Path):
        self.b, self.settings, self.env, self.stem = b, settings, env, stem
        self.rows: list[dict] = []

    def row(self, name: str) -> dict | None:
        return next((r for r in self.rows if r["name"] == name), None)

    def put(self, row: dict, label: str | None = None) -> None:
        """Add ``row``, or replace the row of the same name (a contender measured in rounds, after each)."""
        names = [r["name"] for r in self.rows]
        if row["name"] in names:
            self.rows[names.index(row["name"])] = row
        else:
            self.rows.append(row)
        if self.b.rank == 0:
            detail = f"median {row['median_s']:.3f} s" if row["status"] == "ok" else row.get("reason", "")
            print(f"[bench] {label or row['name']}: {row['status']} {detail}", flush=True)
        self.write()

    def write(self, chart: bool = False) -> list[Path]:
        """Recompute the comparisons and rewrite the files (rank 0; the other ranks write nothing)."""
        if self.b.rank != 0:
            return []
        add_comparisons(self.rows, self.b.spec.steps, self.b.steps)
        self.settings["elapsed_s"] = time.perf_counter() - self.b.t_start
        return write_all(self.rows, self.settings, self.env, self.stem, chart=chart)

    def finish(self) -> None:
        for path in self.write(chart=True):
            print(f"[bench] wrote {path}", flush=True)


def round_order(group: list, r: int) -> list:
    """Round ``r``'s order (r from 0): the group rotated to start at offset r mod k, so no contender always
    runs first and each runs in every position as often as the rounds allow."""
    k = len(group)
    return group[r % k:] + group[:r % k] if k else []


def next_round_fits(b: Bench, active: list[Contender], report: Report) -> tuple[bool, float, float]:
    """Whether one more round of the ``active`` contenders fits the time left, from their own measured rows
    (round 1's warm-up, the median run); (fits, estimated s, s left), the same on every rank."""
    cost = sum(estimate_cost_s(b, c, report.row(c.name)) or 0.0 for c in active)
    left = b.seconds_left()
    return _agree(b, (cost <= left, cost, left))


def measure_in_rounds(b: Bench, group: list[Contender], rounds: int, report: Report
                      ) -> tuple[dict | None, np.ndarray | None]:
    """Measure the eager diffusers/xstage contenders in ``rounds`` interleaved rounds.

    Each round applies, warms up, times every prompt on, and undoes each contender, in ``round_order``: a
    drift of the GPU over the run (clocks, temperature) then hits every contender alike instead of reading
    as a difference between them. A contender skipped or failing in round 1 is not retried (its row says
    why); one failing later keeps its completed rounds and leaves the rest (``round_failure``). Before each
    later round: if it would not fit the time budget, no contender gets more rounds, so all keep the same
    number (``settings["rounds_completed"]``).

    Returns the baseline's row and its round-1 output of the first prompt (the reference of every
    ``output_max_abs_diff_vs_diffusers``).
    """
    settings = report.settings
    results: dict[str, list[RoundResult]] = {c.name: [] for c in group}
    active: list[Contender] = []
    baseline_row, reference = None, None
    for r in range(rounds):
        if r > 0:
            fits, cost, left = next_round_fits(b, active, report)
            if not fits:
                settings["rounds_stopped"] = (f"time budget: round {r + 1} needs ~{cost:.0f} s, "
                                              f"{max(left, 0):.0f} s left")
                if b.rank == 0:
                    print(f"[bench] no more rounds: {settings['rounds_stopped']}", flush=True)
                report.write()
                break
        for contender in round_order(group, r):
            if r == 0:
                status, reason = precheck(b, contender, baseline_row)
                if status is not None:
                    report.put(unmeasured_row(contender, status, reason))
                    continue
                active.append(contender)
            elif contender not in active:
                continue
            label = f"{contender.name} (round {r + 1}/{rounds})"
            prepare_pipeline(b, contender, settings)
            if b.rank == 0:
                print(f"[bench] {label}: running", flush=True)
            result, problems = measure_round(b, contender)
            done = results[contender.name]
            if result is not None:
                done.append(result)
                if r == 0 and contender.name == BASELINE:
                    reference = result.first_output
            if problems:
                active.remove(contender)  # a failure, or a failed undo, would only repeat
            if done:
                # The baseline's own output is the reference: no comparison with itself.
                row = rounds_row(contender, done, None if contender.name == BASELINE else reference, b.steps)
                if problems:
                    why = problems.get("reason") or f"restore failed: {problems['restore_error']}"
                    row["round_failure"] = f"round {r + 1}: {why}"
                    row.update({k: v for k, v in problems.items() if k != "reason"})
            else:
                row = _row(contender, "failed")
                row.update(problems)
            row.update(_info_fields(contender))
            if contender.name == BASELINE and row["status"] == "ok":
                baseline_row = row
            report.put(row, label)
        settings["rounds_completed"] = r + 1
        report.write()
    return baseline_row, reference


# ----------------------------------------------------------------------------------------------------
# Noise-aware comparison: paired latency ratios and a 95% interval of their geometric mean

# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (scipy is not a dependency); past 30
# the normal quantile 1.96 (at most 4% narrower than t's).
T95_TWO_SIDED = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
                 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
                 2.052, 2.048, 2.045, 2.042)


def t95(df: int) -> float:
    """Two-sided 95% quantile of Student's t with ``df`` >= 1 degrees of freedom (1.96 past 30)."""
    if df < 1:
        raise ValueError(f"expected df >= 1, got {df}")
    return T95_TWO_SIDED[df - 1] if df <= len(T95_TWO_SIDED) else 1.96


def ratio_verdict(ratios: Sequence[float]) -> dict:
    """Is a contender slower than the baseline? From paired latency ratios r_i = x_i / base_i.

    The log ratios' mean m and standard error s/sqrt(n) give the 95% t-interval exp(m ± t95(n-1)·s/sqrt(n))
    of the geometric-mean ratio: "slower" when it lies wholly above 1, "faster" wholly below 1, else "same
    within noise"; "one pair: no verdict" with a single pair (no spread, so no noise to compare with);
    "not measured" without pairs. Logs, because latencies scale: 1.1 and 1/1.1 cancel.

    Returns ``{"ratio": geometric mean | None, "ci95": [lo, hi] | None, "verdict": str, "pairs": n}``.

    Example::

        ratio_verdict([1.01, 0.99, 1.00])["verdict"]   # 'same within noise' (ci95 ~ [0.975, 1.025])
        ratio_verdict([1.10, 1.11, 1.09])["verdict"]   # 'slower'
    """
    if any(not (math.isfinite(r) and r > 0) for r in ratios):
        raise ValueError(f"expected positive finite latency ratios, got {list(ratios)}")
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    if n == 0:
        return {"ratio": None, "ci95": None, "verdict": "not measured", "pairs": 0}
    mean = statistics.fmean(logs)
    if n == 1:
        return {"ratio": math.exp(mean), "ci95": None, "verdict": "one pair: no verdict", "pairs": 1}
    half = t95(n - 1) * statistics.stdev(logs) / math.sqrt(n)
    lo, hi = math.exp(mean - half), math.exp(mean + half)
    verdict = "slower" if lo > 1 else "faster" if hi < 1 else "same within noise"
    return {"ratio": math.exp(mean), "ci95": [lo, hi], "verdict": verdict, "pairs": n}


def paired_ratios(row: dict, baselines: Sequence[dict]) -> list[float]:
    """``x_i / base_i`` for every sample i that ``row`` shares with the baseline rows, in order.

    Rows keep their samples round by round, prompt by prompt, so index i is the same (round, prompt) in
    both; a contender that left the rounds early pairs the rounds it has. With several baselines (at one
    round: diffusers before and diffusers-repeat after, an A/B/A bracket) base_i is their geometric mean:
    one pair per sample, since pairing one xstage sample with each baseline would count it twice and
    narrow the interval without any new measurement.
    """
    latencies = row.get("latencies_s") or []
    series = [baseline.get("latencies_s") or [] for baseline in baselines]
    if not series:
        return []
    n = min([len(latencies)] + [len(s) for s in series])
    return [latencies[i] / math.exp(statistics.fmean(math.log(s[i]) for s in series)) for i in range(n)]


def verdict_cell(row: dict) -> str:
    """The table's verdict cell, e.g. 'same within noise (0.996x, 95% CI 0.990-1.002)'."""
    verdict, ratio, ci = row.get("verdict"), row.get("ratio_vs_diffusers"), row.get("ratio_ci95")
    if verdict is None or ratio is None:
        return verdict or ""
    if ci is None:
        return f"{verdict} ({ratio:.3f}x, one pair: no CI)"
    return f"{verdict} ({ratio:.3f}x, 95% CI {ci[0]:.3f}-{ci[1]:.3f})"


# ----------------------------------------------------------------------------------------------------
# Results

# What add_comparisons derives from the measured fields. Cleared before it runs, so it can run again on rows
# it has seen (after every contender, and on --rerender) without leaving a stale value behind.
DERIVED_FIELDS = ("speedup_vs_diffusers_1gpu", "speedup_vs_diffusers_same_compile", "speedup_vs_xstage_serial",
                  "baseline_drift_pct", "baseline_round_spread_pct", "ratio_vs_diffusers", "ratio_ci95",
                  "ratio_pairs", "verdict", "not_slower_than_diffusers", "latency_s_at_default_steps_extrapolated")


def add_comparisons(rows: list[dict], default_steps: int, steps: int) -> None:
    """Ratios of measured medians: against plain diffusers on one GPU (eager: the headline), against
    diffusers with the same compile setting, and calibrated against serial (the difference the
    calibrated schedule makes); the baseline's drift over the run; for each eager xstage row the
    noise-aware verdict against diffusers (``ratio_verdict`` of ``paired_ratios``); plus a labelled
    estimate at the model's default step count."""
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        for key in DERIVED_FIELDS:
            r.pop(key, None)

    def ok_row(name: str) -> dict | None:
        r = by_name.get(name)
        return r if r is not None and r.get("status") == "ok" else None

    def median_of(name: str) -> float | None:
        r = ok_row(name)
        return r["median_s"] if r is not None else None

    base_row, repeat_row = ok_row(BASELINE), ok_row(PlainDiffusersRepeat.family)
    base, repeat = median_of(BASELINE), median_of(PlainDiffusersRepeat.family)
    if base and repeat:
        base_row["baseline_drift_pct"] = 100.0 * (repeat - base) / base
    round_medians = (base_row or {}).get("round_medians_s") or []
    if len(round_medians) >= 2:
        base_row["baseline_round_spread_pct"] = (
            100.0 * (max(round_medians) - min(round_medians)) / statistics.median(round_medians))
    for r in rows:
        if r.get("status") != "ok":
            continue
        suffix = "+compile" if r["compile"] else ""
        same, serial = median_of(BASELINE + suffix), median_of("xstage-serial" + suffix)
        r["speedup_vs_diffusers_1gpu"] = base / r["median_s"] if base else None
        r["speedup_vs_diffusers_same_compile"] = same / r["median_s"] if same else None
        if r["family"] == "xstage-calibrated":
            r["speedup_vs_xstage_serial"] = serial / r["median_s"] if serial else None
        if r["family"].startswith("xstage") and not r["compile"] and base_row is not None:
            # Paired with the diffusers runs of the same round and prompt (at one round: the run before and
            # the repeat after), so drift over the run cancels instead of reading as a speedup.
            stats = ratio_verdict(paired_ratios(r, [x for x in (base_row, repeat_row) if x is not None]))
            r.update(ratio_vs_diffusers=stats["ratio"], ratio_ci95=stats["ci95"], ratio_pairs=stats["pairs"],
                     verdict=stats["verdict"])
            if stats["pairs"] >= 2:  # one pair has no spread: no claim either way
                r["not_slower_than_diffusers"] = stats["verdict"] != "slower"
        if steps != default_steps:
            # Not measured: the measured latency plus the missing steps at the measured step time.
            r["latency_s_at_default_steps_extrapolated"] = (
                r["median_s"] + (default_steps - steps) * r["transformer_step_ms"] / 1e3)


def build_summary(rows: list[dict], settings: dict) -> dict:
    """Headline figures: per contender its status, median latency (s) and speedup over plain diffusers
    on one GPU (and, where present, the baseline's drift and the eager xstage rows' verdicts); with the
    settings they were measured at."""
    contenders = {}
    for r in rows:
        if r["status"] == "ok":
            contenders[r["name"]] = {"status": "ok", "median_latency_s": r["median_s"],
                                     "speedup_vs_diffusers_1gpu": r.get("speedup_vs_diffusers_1gpu")}
            for key in ("baseline_drift_pct", "baseline_round_spread_pct", "not_slower_than_diffusers", "verdict",
                        "ratio_vs_diffusers", "ratio_ci95"):
                if key in r:
                    contenders[r["name"]][key] = r[key]
        else:
            contenders[r["name"]] = {"status": r["status"], "reason": r.get("reason", "")}
    return {"baseline": BASELINE, "measured_at_steps": settings["steps"], "contenders": contenders,
            "settings": settings}


TABLE_COLUMNS = ("name", "status", "median_s", "p90_s", "transformer_step_ms", "peak_memory_gib",
                 "speedup_vs_diffusers_1gpu", "speedup_vs_diffusers_same_compile", "speedup_vs_xstage_serial",
                 "verdict", "output_max_abs_diff_vs_diffusers", "note")


def add_notes(rows: list[dict], settings: dict) -> None:
    """Each row's ``note`` (a table column): why it has no numbers, or what else it carries (compile
    mode, schedules, xfuser's degree-1 path, the baseline's drift, a contender that left the rounds
    early, the default-steps estimate)."""
    for r in rows:
        notes = []
        if r["status"] != "ok":
            notes.append(r.get("reason", ""))
        if r.get("round_failure"):
            notes.append(f"no later rounds after {r['round_failure']}")
        if r.get("compile_mode"):
            notes.append(f"compile: {r['compile_mode']}")
        if r.get("xfuser_naive_forward"):
            notes.append("xfuser at degree 1 runs the unmodified diffusers pipeline")
        if r.get("schedules"):
            notes.append("schedules: " + json.dumps(r["schedules"], ensure_ascii=False)[:300])
        if "baseline_drift_pct" in r:
            notes.append(f"drift {r['baseline_drift_pct']:+.1f}% by diffusers-repeat")
        if "baseline_round_spread_pct" in r:
            notes.append(f"round medians {', '.join(f'{m:.3f}' for m in r['round_medians_s'])} s "
                         f"(spread {r['baseline_round_spread_pct']:.1f}%)")
        if "latency_s_at_default_steps_extrapolated" in r:
            notes.append(f"{r['latency_s_at_default_steps_extrapolated']:.2f} s at {settings['default_steps']} "
                         "steps (extrapolated from the measured step time, not measured)")
        r["note"] = "; ".join(n for n in notes if n).replace("|", "/").replace("\n", " ")


def rounds_text(settings: dict) -> str:
    """How the eager group was ordered: interleaved rounds, or once each with the A/B/A repeat."""
    rounds = settings.get("rounds", 1)  # results written before --rounds existed: one round
    if rounds < 2:
        return ("diffusers-repeat: plain diffusers again after the eager xstage contenders (an A/B/A order), "
                "a second baseline the xstage rows pair with.")
    done = settings.get("rounds_completed", rounds)
    stopped = f", stopped by the {settings['rounds_stopped']}" if settings.get("rounds_stopped") else ""
    return (f"The eager diffusers and xstage contenders ran in {done} interleaved rounds ({rounds} requested"
            f"{stopped}): each round applies, warms up, times every prompt and undoes each of them, in an order "
            "rotated every round; median_s / p90_s are over all rounds and prompts. The torch.compile variants and "
            "the other stacks ran once, after them (compiling again every round would cost minutes).")


def notes_text(settings: dict) -> str:
    s = settings
    size = f"{s['height']}x{s['width']}" + (f", {s['frames']} frames" if s["kind"] == "video" else "")
    return "\n".join([
        f"Model {s['model']} ({s['family']}, {size}), **measured at {s['steps']} denoising steps** (model "
        f"default {s['default_steps']}), guidance {s['guidance']}, seed {s['seed']}, {s['dtype']}, "
        f"{s['gpus']} GPU(s); {s['num_prompts']} prompt(s) from xstage_dit/bench/prompts.txt per contender, each after "
        f"{s['warmup']} warm-up run(s) of {s['warmup_steps']} step(s).",
        "",
        "median_s / p90_s: the whole pipeline call (text encoders, denoising, VAE decode), one run per prompt. "
        "transformer_step_ms: CUDA events around every transformer forward, summed per denoising step "
        "(CFG pipelines run two forwards a step). peak_memory_gib: torch.cuda.max_memory_allocated, reset per "
        "contender. speedup_vs_diffusers_1gpu: plain diffusers on one GPU (eager) / contender; "
        "speedup_vs_xstage_serial: the difference the calibrated schedule makes. " + rounds_text(s),
        "",
        "verdict (eager xstage rows): the geometric mean of the paired latency ratios xstage / diffusers (same "
        "round, same prompt; below 1 = faster) with its 95% t-interval; \"slower\" or \"faster\" only when the "
        "interval lies wholly above or below 1, else \"same within noise\". not_slower_than_diffusers (JSON): the "
        "verdict is not \"slower\".",
        "",
        f"Command: `{s['command']}`",
    ])


def bar_chart(rows: list[dict], settings: dict, gpu: str | None, path: Path) -> Path | None:
    """Median latency per measured contender, labelled with its speedup over plain diffusers on one GPU."""
    rows = [r for r in rows if r["status"] == "ok"]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    medians = [r["median_s"] for r in rows]
    colors = ["#1f77b4" if r["family"].startswith("xstage") else "#7f7f7f" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.5))
    bars = ax.bar(range(len(rows)), medians, color=colors)
    for bar, r in zip(bars, rows):
        speedup = r.get("speedup_vs_diffusers_1gpu")
        ax.annotate(f"{speedup:.2f}x" if speedup else "", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=9, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=20, ha="right")
    ax.set_ylabel("median end-to-end latency (s)")
    ax.set_title(f"{settings['model']}, {settings['gpus']}x {gpu or 'CPU'}, {settings['height']}x{settings['width']}, "
                 f"{settings['steps']} steps (label: speedup vs diffusers 1-GPU)", fontsize=9)
    ax.set_ylim(0, max(medians) * 1.15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(rows: list[dict], settings: dict, env: dict, stem: Path, chart: bool,
              extra: dict | None = None) -> list[Path]:
    """``<stem>.json`` + ``.md`` through the shared writer, and the bar chart ``<stem>.png``; ``extra``: more
    top-level keys of the JSON (``provenance``)."""
    add_notes(rows, settings)
    # The table's verdict cell carries the ratio and its interval; the JSON keeps them as separate fields.
    table_rows = [dict(r, verdict=verdict_cell(r)) if "verdict" in r else r for r in rows]
    paths = list(write_results(stem, "e2e", rows, build_summary(rows, settings), columns=TABLE_COLUMNS,
                               notes=notes_text(settings), env=env, table_rows=table_rows, extra=extra))
    if chart:
        png = bar_chart(rows, settings, env.get("gpu"), stem.parent / f"{stem.name}.png")
        if png is not None:
            paths.append(png)
    return paths


def rerender(path: str | Path) -> list[Path]:
    """Recompute the comparisons, verdicts, summary and notes of a results JSON written by this script with
    the current code, and rewrite its .json/.md/.png in place. Measures nothing: the measured fields
    (latencies, step times, memory), the settings and the environment stay as they are; the JSON's
    ``provenance.rerendered`` records the commit that recomputed them (earlier provenance is kept)."""
    from benchmarks._common import git_commit
    from xstage_dit.cli import UsageError

    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"expected --rerender to be a results JSON written by xstage-dit bench, got {str(path)!r} "
                         f"({_error(exc)})") from None
    settings = doc.get("summary", {}).get("settings") if isinstance(doc, dict) else None
    if not (isinstance(doc, dict) and doc.get("benchmark") == "e2e" and isinstance(doc.get("rows"), list)
            and isinstance(settings, dict) and isinstance(doc.get("environment"), dict)):
        raise UsageError(f"expected --rerender to be a results JSON written by xstage-dit bench (benchmark 'e2e' with "
                         f"environment, rows and summary.settings), got {str(path)!r}")
    rows = doc["rows"]
    add_comparisons(rows, settings["default_steps"], settings["steps"])
    extra = {k: v for k, v in doc.items() if k not in ("benchmark", "environment", "summary", "rows")}
    extra["provenance"] = dict(doc.get("provenance") or {}, rerendered={
        "at_commit": git_commit(), "what": "comparisons and verdicts recomputed from the measured latencies"})
    stem = path.parent / path.name.removesuffix(".json")
    return write_all(rows, settings, doc["environment"], stem, chart=True, extra=extra)


# ----------------------------------------------------------------------------------------------------
# Entry points


def option_argv(args: argparse.Namespace) -> list[str]:
    """The options of this run as an argument list (what repeats it, and what each launched rank gets)."""
    argv = []
    for key, value in vars(args).items():
        if key in ("func", "command") or value is None or value is False:
            continue
        argv += ["--" + key.replace("_", "-")] + ([] if value is True else [str(value)])
    return argv


def command_line(args: argparse.Namespace) -> str:
    """The options of this run as a command line (what to type to repeat it)."""
    import shlex

    return " ".join(["xstage-dit bench"] + [shlex.quote(a) for a in option_argv(args)])


def launch_ranks(args: argparse.Namespace, gpus: int) -> int:
    """Start ``gpus`` ranks of this benchmark on this machine (as torchrun would) and wait for them."""
    from xstage_dit.cli import UsageError

    try:
        from xstage_dit.comm.launcher import launch
    except ImportError:
        raise UsageError(f"expected a launch of {gpus} ranks (torchrun --nproc-per-node {gpus} "
                         f"xstage_dit/bench/e2e.py ...), got --gpus {gpus} in a single process") from None
    if torch.cuda.is_available() and args.device != "cpu" and torch.cuda.device_count() < gpus:
        raise UsageError(f"expected --gpus <= the {torch.cuda.device_count()} visible GPU(s), got --gpus {gpus}")
    return launch(gpus, [sys.executable, "-m", "xstage_dit.bench.e2e", *option_argv(args)])


def _resolve_device(choice: str) -> torch.device:
    from xstage_dit.cli import UsageError

    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UsageError("expected a CUDA GPU for --device cuda, got none")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_benchmark(args: argparse.Namespace) -> int:
    """Run every contender on every prompt and write the results; returns the exit code."""
    from xstage_dit.cli import UsageError
    from xstage_dit.comm.distributed import init_distributed
    from xstage_dit.models import load_pipeline, model_spec

    t_start = time.perf_counter()
    bench_cli.validate(args)
    if args.rerender:
        for path in rerender(args.rerender):
            print(f"[bench] rewrote {path}", flush=True)
        return 0
    names = bench_cli.parse_contenders(args.contenders)
    try:
        spec = model_spec(args.model)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    gpus = args.gpus if args.gpus is not None else launched
    if launched == 1 and gpus > 1:
        return launch_ranks(args, gpus)  # every rank runs this function again, under WORLD_SIZE=gpus
    if gpus != launched:
        raise UsageError(f"expected --gpus to equal the launched ranks (WORLD_SIZE={launched}), got --gpus {gpus}")
    info = init_distributed()
    device = _resolve_device(args.device) if info.world_size == 1 else info.device
    dtype = DTYPES["bf16" if device.type == "cuda" else "fp32"] if args.dtype == "auto" else DTYPES[args.dtype]
    steps = args.steps or spec.steps
    height, width = args.height or spec.height, args.width or spec.width
    frames = (args.frames or spec.frames) if spec.kind == "video" else 1
    try:
        prompts = load_prompts(args.prompts, args.num_prompts)
        spec.check_size(height, width, frames)  # a bad size fails here, before the model is built
    except ValueError as exc:
        raise UsageError(str(exc)) from None

    t0 = time.perf_counter()
    pipe = load_pipeline(args.model, dtype=dtype, device=device, seed=args.seed)
    pipe.set_progress_bar_config(disable=True)
    build_s = time.perf_counter() - t0
    b = Bench(args=args, spec=spec, pipe=pipe, device=device, dtype=dtype, rank=info.rank,
              world_size=info.world_size, prompts=prompts, steps=steps, height=height, width=width, frames=frames,
              t_start=t_start, build_s=build_s)
    b.call_kwargs(prompts[0], steps)  # validates steps, size and the pipeline's arguments up front

    env = environment()  # its git commit falls back to $XSTAGE_GIT_COMMIT where the tree has no .git
    stem = Path(args.out_dir) / f"e2e-{model_slug(args.model)}-{gpus}x{gpu_label(device)}"
    settings = {
        "model": args.model, "kind": spec.kind, "family": spec.family, "gpus": gpus, "world_size": info.world_size,
        "height": height, "width": width, "frames": frames, "steps": steps, "default_steps": spec.steps,
        "guidance": spec.guidance, "seed": args.seed, "dtype": str(dtype).replace("torch.", ""),
        "num_prompts": len(prompts), "prompts": prompts, "warmup": args.warmup,
        "warmup_steps": min(args.warmup_steps, steps), "compile_requested": bool(args.compile),
        "time_budget_s": args.time_budget_s or None, "model_build_s": build_s, "command": command_line(args),
        # measure_in_rounds counts the rounds every eager contender of our group completed.
        "rounds": args.rounds, "rounds_completed": 1 if args.rounds == 1 else 0,
    }
    report = Report(b, settings, env, stem)
    contenders = make_contenders(names, args.compile, info.world_size, rounds=args.rounds)
    # Only the eager group goes in rounds: a compiled variant would compile again every round (minutes on a
    # full-size model), and the other stacks cannot all be undone or must not run before ours (xfuser).
    interleaved = ([c for c in contenders if c.family in OUR_FAMILIES and not c.compile]
                   if args.rounds >= 2 else [])
    baseline_row, reference = None, None
    if interleaved:
        baseline_row, reference = measure_in_rounds(b, interleaved, args.rounds, report)
    for contender in contenders:
        if contender in interleaved:
            continue
        status, reason = precheck(b, contender, baseline_row)
        if status is not None:
            report.put(unmeasured_row(contender, status, reason))
            continue
        prepare_pipeline(b, contender, settings)
        if info.rank == 0:
            print(f"[bench] {contender.name}: running", flush=True)
        row, output = measure(b, contender, reference)
        if contender.name == BASELINE and row["status"] == "ok":
            baseline_row, reference = row, output
        report.put(row)
    report.finish()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    base_ok = any(r["name"] == BASELINE and r["status"] == "ok" for r in report.rows)
    return 0 if base_ok or BASELINE not in names else 1


def main(argv: list[str] | None = None) -> int:
    from xstage_dit.cli import UsageError

    parser = argparse.ArgumentParser(prog="bench_e2e.py", description=__doc__.split("\n\n")[0])
    bench_cli.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_benchmark(args)
    except UsageError as exc:
        parser.exit(2, f"bench_e2e.py: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
