#!/usr/bin/env python3
"""End-to-end latency on sample prompts: xstage_dit against what users run today (issue 8).

For one model and one GPU count, every prompt of ``benchmarks/prompts.txt`` runs through each
contender with the same seed, size and steps, after warm-up. Per contender it reports the end-to-end
latency (median, p90), the transformer time per denoising step (CUDA events around every transformer
forward, from forward pre/post hooks), the peak GPU memory (``torch.cuda.max_memory_allocated``, reset
per contender) and the speedup over plain diffusers on one GPU. Contenders share one loaded pipeline:
each is applied, measured and undone in turn, so a 12-14B parameter model is built once.

Writes ``<out-dir>/e2e-<model>-<gpus>x<gpu>.json`` (top-level ``summary``: per contender the median
latency in seconds and the speedup over plain diffusers on one GPU), ``.md`` (table) and ``.png``
(bar chart). The JSON and the table are rewritten after every contender, so a run cut short by a
time limit still leaves what it measured.

Usage (the options are those of ``xstage-dit bench``; see ``--help``)::

    python benchmarks/bench_e2e.py --model tiny-flux --num-prompts 1 --steps 2          # CPU smoke run
    python benchmarks/bench_e2e.py --model full-flux --num-prompts 3 --compile          # one H200
    torchrun --nproc-per-node 4 benchmarks/bench_e2e.py --model full-flux --gpus 4      # four GPUs
    python benchmarks/bench_e2e.py --model full-flux --gpus 4     # the same: starts its 4 ranks itself

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
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
# The checkout's xstage_dit and benchmarks package first: xfuser's wheel installs a top-level
# `benchmarks` directory of its own into site-packages.
if sys.path[:1] != [str(REPO_ROOT)]:
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._common import environment, write_results  # noqa: E402
from xstage_dit.commands import bench as bench_cli  # noqa: E402
from xstage_dit.jsonable import to_jsonable  # noqa: E402

BASELINE = "diffusers"
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
    """Plain diffusers again, after the eager xstage contenders (an A/B/A order): the baseline's own drift
    over the run (clocks, temperature) is the yardstick for "not slower than diffusers"."""

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


def make_contenders(names: list[str], with_compile: bool, world_size: int = 1) -> list[Contender]:
    """Run order: diffusers and xstage eager (the baseline leading), then their compiled variants, then
    the other reversible stacks, then each irreversible contender with its compiled variant (they leave
    the pipeline modified)."""
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
    ours = [c for c in eager + compiled if c.family in ("diffusers", "xstage-serial", "xstage-calibrated")]
    if "diffusers" in names and any(n.startswith("xstage") for n in names):
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


def estimate_cost_s(b: Bench, contender: Contender, baseline: dict | None) -> float | None:
    """Seconds a contender should take, from the eager baseline's measured warm-up and runs (plus the
    assumed compile time, plus a rebuild of the pipeline when it needs a pristine one)."""
    if baseline is None or baseline.get("status") != "ok":
        return None
    cost = baseline["warmup_s"] + baseline["median_s"] * len(b.prompts)
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


def measure(b: Bench, contender: Contender, reference: np.ndarray | None) -> tuple[dict, np.ndarray | None]:
    """Apply, warm up, time every prompt, undo. Returns the row and the first prompt's output."""
    row = _row(contender, "failed")
    stopwatch = Stopwatch(b.device)
    first_output = None
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
        for i, prompt in enumerate(b.prompts):
            latency, output = stopwatch.time(lambda: contender.call(b, b.call_kwargs(prompt, b.steps)))
            transformer_s, calls = timer.collect()
            latencies.append(latency)
            step_times.append(transformer_s / b.steps)
            forwards.append(calls)
            if i == 0:
                first_output = _output_array(output)
        row.update(
            status="ok",
            median_s=statistics.median(latencies),
            p90_s=percentile(latencies, 90),
            transformer_step_ms=1e3 * statistics.median(step_times),
            peak_memory_gib=(torch.cuda.max_memory_allocated(b.device) / 2**30 if b.device.type == "cuda" else None),
            latencies_s=latencies,
            transformer_step_ms_all=[1e3 * t for t in step_times],
            transformer_forwards_per_step=statistics.median(forwards) / b.steps,
            setup_s=setup_s,
            warmup_s=warmup_s,
        )
        if reference is not None and first_output is not None and first_output.shape == reference.shape:
            row["output_max_abs_diff_vs_diffusers"] = float(np.abs(first_output - reference).max())
    except Exception as exc:
        row.update(status="failed", reason=_error(exc), traceback=traceback.format_exc(limit=8)[-4000:])
        if b.device.type == "cuda":
            torch.cuda.empty_cache()
    finally:
        if timer is not None:
            timer.remove()
        if applied:
            try:
                contender.restore(b)
            except Exception as exc:  # the next contender gets a freshly built pipeline instead
                row["restore_error"] = _error(exc)
                b.dirty = f"{contender.name} (restore failed)"
    row.update({k: v for k, v in contender.info.items() if k != "skip_reason"})
    return row, first_output


# ----------------------------------------------------------------------------------------------------
# Results


def add_comparisons(rows: list[dict], default_steps: int, steps: int) -> None:
    """Ratios of measured medians: against plain diffusers on one GPU (eager: the headline), against
    diffusers with the same compile setting, and calibrated against serial (the difference the
    calibrated schedule makes); plus a labelled estimate at the model's default step count."""
    by_name = {r["name"]: r for r in rows}

    def median_of(name: str) -> float | None:
        r = by_name.get(name)
        return r["median_s"] if r is not None and r.get("status") == "ok" else None

    base = median_of(BASELINE)
    repeat = median_of(PlainDiffusersRepeat.family)
    if base and repeat:
        by_name[BASELINE]["baseline_drift_pct"] = 100.0 * (repeat - base) / base
    for r in rows:
        if r.get("status") != "ok":
            continue
        suffix = "+compile" if r["compile"] else ""
        same, serial = median_of(BASELINE + suffix), median_of("xstage-serial" + suffix)
        r["speedup_vs_diffusers_1gpu"] = base / r["median_s"] if base else None
        r["speedup_vs_diffusers_same_compile"] = same / r["median_s"] if same else None
        if r["family"] == "xstage-calibrated":
            r["speedup_vs_xstage_serial"] = serial / r["median_s"] if serial else None
        if r["family"].startswith("xstage") and not r["compile"] and base and repeat:
            # Not slower: no slower than the slower of the two baseline runs that bracket it.
            r["not_slower_than_diffusers"] = r["median_s"] <= max(base, repeat)
        if steps != default_steps:
            # Not measured: the measured latency plus the missing steps at the measured step time.
            r["latency_s_at_default_steps_extrapolated"] = (
                r["median_s"] + (default_steps - steps) * r["transformer_step_ms"] / 1e3)


def build_summary(rows: list[dict], settings: dict) -> dict:
    """Headline figures: per contender its status, median latency (s) and speedup over plain diffusers
    on one GPU; with the settings they were measured at."""
    contenders = {}
    for r in rows:
        if r["status"] == "ok":
            contenders[r["name"]] = {"status": "ok", "median_latency_s": r["median_s"],
                                     "speedup_vs_diffusers_1gpu": r.get("speedup_vs_diffusers_1gpu")}
            for key in ("baseline_drift_pct", "not_slower_than_diffusers"):
                if key in r:
                    contenders[r["name"]][key] = r[key]
        else:
            contenders[r["name"]] = {"status": r["status"], "reason": r.get("reason", "")}
    return {"baseline": BASELINE, "measured_at_steps": settings["steps"], "contenders": contenders,
            "settings": settings}


TABLE_COLUMNS = ("name", "status", "median_s", "p90_s", "transformer_step_ms", "peak_memory_gib",
                 "speedup_vs_diffusers_1gpu", "speedup_vs_diffusers_same_compile", "speedup_vs_xstage_serial",
                 "output_max_abs_diff_vs_diffusers", "note")


def add_notes(rows: list[dict], settings: dict) -> None:
    """Each row's ``note`` (a table column): why it has no numbers, or what else it carries (compile
    mode, schedules, xfuser's degree-1 path, the default-steps estimate)."""
    for r in rows:
        notes = []
        if r["status"] != "ok":
            notes.append(r.get("reason", ""))
        if r.get("compile_mode"):
            notes.append(f"compile: {r['compile_mode']}")
        if r.get("xfuser_naive_forward"):
            notes.append("xfuser at degree 1 runs the unmodified diffusers pipeline")
        if r.get("schedules"):
            notes.append("schedules: " + json.dumps(r["schedules"], ensure_ascii=False)[:300])
        if "latency_s_at_default_steps_extrapolated" in r:
            notes.append(f"{r['latency_s_at_default_steps_extrapolated']:.2f} s at {settings['default_steps']} "
                         "steps (extrapolated from the measured step time, not measured)")
        r["note"] = "; ".join(n for n in notes if n).replace("|", "/").replace("\n", " ")


def notes_text(settings: dict) -> str:
    s = settings
    size = f"{s['height']}x{s['width']}" + (f", {s['frames']} frames" if s["kind"] == "video" else "")
    return "\n".join([
        f"Model {s['model']} ({s['family']}, {size}), **measured at {s['steps']} denoising steps** (model "
        f"default {s['default_steps']}), guidance {s['guidance']}, seed {s['seed']}, {s['dtype']}, "
        f"{s['gpus']} GPU(s); {s['num_prompts']} prompt(s) from benchmarks/prompts.txt per contender, each after "
        f"{s['warmup']} warm-up run(s) of {s['warmup_steps']} step(s).",
        "",
        "median_s / p90_s: the whole pipeline call (text encoders, denoising, VAE decode), one run per prompt. "
        "transformer_step_ms: CUDA events around every transformer forward, summed per denoising step "
        "(CFG pipelines run two forwards a step). peak_memory_gib: torch.cuda.max_memory_allocated, reset per "
        "contender. speedup_vs_diffusers_1gpu: plain diffusers on one GPU (eager) / contender; "
        "speedup_vs_xstage_serial: the difference the calibrated schedule makes. diffusers-repeat: plain diffusers "
        "again after the eager xstage contenders; an xstage row is not slower when its median is at most the "
        "slower of the two diffusers runs.",
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


def write_all(rows: list[dict], settings: dict, env: dict, stem: Path, chart: bool) -> list[Path]:
    """``<stem>.json`` + ``.md`` through the shared writer, and the bar chart ``<stem>.png``."""
    add_notes(rows, settings)
    paths = list(write_results(stem, "e2e", rows, build_summary(rows, settings), columns=TABLE_COLUMNS,
                               notes=notes_text(settings), env=env))
    if chart:
        png = bar_chart(rows, settings, env.get("gpu"), stem.with_suffix(".png"))
        if png is not None:
            paths.append(png)
    return paths


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
        from xstage_dit.launch import launch
    except ImportError:
        raise UsageError(f"expected a launch of {gpus} ranks (torchrun --nproc-per-node {gpus} "
                         f"benchmarks/bench_e2e.py ...), got --gpus {gpus} in a single process") from None
    if torch.cuda.is_available() and args.device != "cpu" and torch.cuda.device_count() < gpus:
        raise UsageError(f"expected --gpus <= the {torch.cuda.device_count()} visible GPU(s), got --gpus {gpus}")
    return launch(gpus, [sys.executable, str(Path(__file__).resolve()), *option_argv(args)])


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
    from xstage_dit.distributed import init_distributed
    from xstage_dit.models import load_pipeline, model_spec

    t_start = time.perf_counter()
    bench_cli.validate(args)
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
    }
    rows: list[dict] = []
    baseline_row, reference = None, None
    for contender in make_contenders(names, args.compile, info.world_size):
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
        if status is not None:
            row = _row(contender, status, reason)
            row.update({k: v for k, v in contender.info.items() if k != "skip_reason"})
        else:
            if not contender.accepts(b.dirty):
                if info.rank == 0:
                    print(f"[bench] rebuilding the pipeline (left modified by {b.dirty})", flush=True)
                b.rebuild()
                settings.setdefault("rebuilds_s", []).append(b.build_s)
            if info.rank == 0:
                print(f"[bench] {contender.name}: running", flush=True)
            row, output = measure(b, contender, reference)
            if contender.name == BASELINE and row["status"] == "ok":
                baseline_row, reference = row, output
        rows.append(row)
        if info.rank == 0:
            detail = f"median {row['median_s']:.3f} s" if row["status"] == "ok" else row.get("reason", "")
            print(f"[bench] {contender.name}: {row['status']} {detail}", flush=True)
            add_comparisons(rows, spec.steps, steps)
            settings["elapsed_s"] = time.perf_counter() - t_start
            # Rewritten after every contender: a run cut short still leaves what it measured.
            write_all(rows, settings, env, stem, chart=False)
    if info.rank == 0:
        for path in write_all(rows, settings, env, stem, chart=True):
            print(f"[bench] wrote {path}", flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    base_ok = any(r["name"] == BASELINE and r["status"] == "ok" for r in rows)
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
