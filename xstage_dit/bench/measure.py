"""Measuring contenders: timing (whole calls and every transformer forward), one round of a contender
(apply, warm up, one run per prompt, undo), the skip decisions every rank takes alike, and the eager
group in interleaved rounds (`measure_in_rounds`)."""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
import traceback
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from xstage_dit._torch_private import compile_seconds, compile_seconds_since, frames_converted
from xstage_dit.bench.contenders import Contender
from xstage_dit.bench.finite import NonFiniteWatch
from xstage_dit.bench.options import BASELINE
from xstage_dit.bench.session import Bench, error_text
from xstage_dit.bench.stats import percentile
from xstage_dit.families.spec import TEXT_ENCODER_COMPONENTS
from xstage_dit.runtime.gc_pauses import GcPauses

if TYPE_CHECKING:  # the report only for annotations: it imports nothing of this module either
    from xstage_dit.bench.report import Report


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


class StageTimers:
    """The pipeline's stages outside the transformer, timed like it (`TransformerTimer` on each module): the VAE
    decoder's forwards ("vae_decode") and the text encoders' ("text_encode"). ``collect()`` -> {stage: seconds
    since the last collect (0 where its modules ran no forward: a prompt served from the prompt cache), or None
    where the pipeline has no such module}. Module hooks: a compiled forward (an instance ``forward``) stays
    inside them. The in-process server runs the bench's own pipeline, so its calls are timed too."""

    def __init__(self, pipe, device: torch.device):
        decoder = getattr(getattr(pipe, "vae", None), "decoder", None)
        encoders = [getattr(pipe, name, None) for name in TEXT_ENCODER_COMPONENTS]
        stages = {"vae_decode": [decoder], "text_encode": encoders}
        self._timers = {stage: [TransformerTimer(m, device) for m in modules if isinstance(m, torch.nn.Module)]
                        for stage, modules in stages.items()}

    def collect(self) -> dict[str, float | None]:
        out = {}
        for stage, timers in self._timers.items():
            out[stage] = sum(timer.collect()[0] for timer in timers) if timers else None
        return out

    def remove(self) -> None:
        for timers in self._timers.values():
            for timer in timers:
                timer.remove()


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
    """Seconds ``rounds`` rounds of a contender should take (each round: its warm-up and ``--repeats`` runs per prompt),
    from a measured row (the eager baseline's, or the contender's own), plus the assumed compile time and a
    rebuild of the pipeline when it needs a pristine one (both paid once)."""
    if measured is None or measured.get("status") != "ok":
        return None
    cost = rounds * (measured["warmup_s"] + measured["median_s"] * len(b.prompts) * b.args.repeats)
    if contender.compile:
        cost += b.args.compile_estimate_s
    if not contender.accepts(b.dirty):
        cost += b.build_s
    return cost


def observed_cost_s(b: Bench, contender: Contender, rows: list[dict]) -> float | None:
    """Seconds the costliest measured row of the contender's kind (the same compile setting, FP8 or not) took
    from apply to its last timed run (set-up, warm-up, the timed runs), plus a rebuild where the contender needs
    one; None before any.

    Why: ``--compile-estimate-s`` is one guess for every compiled row, and it can be far off: compiling FLUX's
    FP8 blocks took 130-290 s on an H100 (2026-12-06), so a compiled FP8 row started with 100 s left ran until
    the call was killed and left nothing. A row measured in the same run is the better estimate.

    The same stack's rows first (xstage's by xstage's, a peer's by the peers'), any of the kind where it has none
    yet: the peers' FP8 recipe turns on Inductor's coordinate-descent tuning (torchao's default), so its compile
    costs minutes that xstage's FP8 rows, compiled untuned, do not (fp8/NOTES.md, 2026-12-07)."""
    fp8, xstage = "fp8" in contender.family, contender.family.startswith("xstage")
    kind = [r for r in rows if r.get("status") == "ok" and r.get("compile") == contender.compile and "setup_s" in r
            and ("fp8" in r.get("family", "")) == fp8]
    same_stack = [r for r in kind if r.get("family", "").startswith("xstage") == xstage]
    costs = [r["setup_s"] + r["warmup_s"] + r["median_s"] * len(b.prompts) * b.args.repeats
             for r in (same_stack or kind)]
    if not costs:
        return None
    return max(costs) + (0.0 if contender.accepts(b.dirty) else b.build_s)


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
    """One round of one contender: applied, warmed up, ``--repeats`` timed runs per prompt (in prompt order),
    undone."""

    latencies_s: list[float]  # per run: prompt by prompt, each prompt's repeats together
    step_s: list[float]  # transformer seconds per denoising step, per run
    forwards: list[int]  # transformer forwards, per run
    setup_s: float
    warmup_s: float
    peak_memory_gib: float | None  # None on the CPU
    first_output: np.ndarray | None  # the first prompt's output, to compare contenders' results
    # Dynamo frames converted (each a trace, and a graph unless it breaks) while applying and warming up, and
    # during the timed runs (a nonzero count there is a recompile inside the timing)
    frames_warmup: int = 0
    frames_timed: int = 0
    compile_s: dict = dataclasses.field(default_factory=dict)  # torch.compile's phases while applying and warming up
    stages_s: list = dataclasses.field(default_factory=list)  # per run: `StageTimers.collect()`
    # What a host-bound timed run reads first: the garbage collector's pauses (any thread: they stop every
    # thread's Python), and cuDNN FP8 attention's calls by how they bound their operands (`_fp8_attention_packs`)
    gc_s_timed: float = 0.0
    fp8_attention_packs_timed: dict = dataclasses.field(default_factory=dict)
    nonfinite_timed: bool = False  # a timed forward's output held a NaN or an infinity (`bench.finite`)


def _fp8_attention_packs() -> dict[str, int]:
    """cuDNN FP8 attention's calls so far by binding ({"uid": n, "tensor": m}); {} where it never ran here."""
    module = sys.modules.get("xstage_dit.ops.attention.cudnn_fp8")  # imported by whatever ran it, else never ran
    return module.pack_counts() if module is not None else {}


def measure_round(b: Bench, contender: Contender) -> tuple[RoundResult | None, dict]:
    """Apply, warm up, time every prompt, undo.

    Returns the round (None when it failed) and what went wrong as row fields: ``reason`` and ``traceback``
    of a failure, ``restore_error`` when undoing failed (the pipeline is then marked dirty, so the next
    contender gets a freshly built one).
    """
    stopwatch = Stopwatch(b.device)
    problems: dict = {}
    result = None
    timer = stages = pauses = watch = None
    applied = False
    try:
        frames0, compiled0 = frames_converted(), compile_seconds()
        t0 = time.perf_counter()
        applied = True  # a half-applied contender is undone too: every restore() tolerates that
        contender.apply(b)
        setup_s = time.perf_counter() - t0
        if b.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(b.device)
        timed = contender.timed_module(b)
        timer = TransformerTimer(timed, b.device)
        # after the timer's hooks (outside its spans), and before the warm-up: the same hooks then as when timed
        watch = NonFiniteWatch(timed)
        stages = StageTimers(b.pipe, b.device)
        warmup_steps = min(b.args.warmup_steps, b.steps)
        t0 = time.perf_counter()
        for _ in range(b.args.warmup):
            contender.call(b, b.call_kwargs(b.prompts[0], warmup_steps))
        if b.device.type == "cuda":
            torch.cuda.synchronize()
        warmup_s = time.perf_counter() - t0
        frames1 = frames_converted()
        compiled = compile_seconds_since(compiled0)
        timer.collect()
        stages.collect()
        latencies, step_times, forwards, stage_times = [], [], [], []
        first_output = None
        pauses, packs0 = GcPauses().install(), _fp8_attention_packs()
        watch.reset()  # the timed runs' outputs only
        for i, prompt in enumerate(b.prompts):
            for repeat in range(b.args.repeats):
                latency, output = stopwatch.time(lambda: contender.call(b, b.call_kwargs(prompt, b.steps)))
                transformer_s, calls = timer.collect()
                latencies.append(latency)
                step_times.append(transformer_s / b.steps)
                forwards.append(calls)
                stage_times.append(stages.collect())
                if i == 0 and repeat == 0:
                    first_output = _output_array(output)
        pauses.uninstall()
        packs = {k: n - packs0.get(k, 0) for k, n in _fp8_attention_packs().items()}
        peak = torch.cuda.max_memory_allocated(b.device) / 2**30 if b.device.type == "cuda" else None
        result = RoundResult(latencies, step_times, forwards, setup_s, warmup_s, peak, first_output,
                             frames1 - frames0, frames_converted() - frames1, compiled, stage_times,
                             pauses.total_s(), {k: n for k, n in packs.items() if n}, watch.seen())
    except Exception as exc:
        problems.update(reason=error_text(exc), traceback=traceback.format_exc(limit=8)[-4000:])
        if b.device.type == "cuda":
            torch.cuda.empty_cache()
    finally:
        if pauses is not None:
            pauses.uninstall()
        for hooks in (timer, stages, watch):
            if hooks is not None:
                hooks.remove()
        if applied:
            try:
                contender.restore(b)
            except Exception as exc:  # the next contender gets a freshly built pipeline instead
                problems["restore_error"] = error_text(exc)
                b.dirty = f"{contender.name} (restore failed)"
    return result, problems


def rounds_row(contender: Contender, results: list[RoundResult], reference: np.ndarray | None, steps: int) -> dict:
    """The "ok" row of a contender measured in ``len(results)`` >= 1 rounds of ``steps`` denoising steps.

    Medians and p90 are over every (round, prompt, repeat) sample; ``latencies_s`` keeps the samples round by
    round, prompt by prompt, repeat by repeat (what ``paired_ratios`` pairs on); the peak memory is the highest
    of any round; set-up and warm-up times are round 1's (what the budget estimates from); the output is compared
    on round 1.
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
        dynamo_frames_setup_warmup=results[0].frames_warmup,
        dynamo_frames_timed=sum(r.frames_timed for r in results),
        compile_s_setup_warmup=results[0].compile_s,
        gc_pause_s_timed=sum(r.gc_s_timed for r in results),
        transformer_output_finite=not any(r.nonfinite_timed for r in results),
        **stage_fields(results, steps),
    )
    packs = [r.fp8_attention_packs_timed for r in results if r.fp8_attention_packs_timed]
    # a contender that asked for FP8 attention records its count even at zero: NucleusMoE's FP8-attention rows made
    # no call (its masked attention goes to SDPA), which an absent field did not say (fp8/NOTES.md)
    if packs or getattr(contender, "fp8_attention", "off") != "off":
        row["cudnn_fp8_calls_timed"] = {k: sum(p.get(k, 0) for p in packs) for k in ("uid", "tensor")}
    first = results[0].first_output
    if reference is not None and first is not None and first.shape == reference.shape:
        row["output_max_abs_diff_vs_diffusers"] = float(np.abs(first - reference).max())
    return row


def stage_fields(results: list[RoundResult], steps: int) -> dict:
    """Where a run's time goes (JSON fields, medians over every run): ``text_encode_ms``, ``transformer_ms`` (all
    its forwards), ``vae_decode_ms``, and ``other_ms``, the rest of the call (scheduler, hooks, host work, gaps
    between stages); a stage the pipeline does not have is None, and ``other_ms`` then counts its time."""
    runs = [(latency, step * steps, stage) for r in results
            for latency, step, stage in zip(r.latencies_s, r.step_s, r.stages_s or [{}] * len(r.latencies_s))]
    if not runs:
        return {}

    def median_ms(values):
        return None if any(v is None for v in values) else 1e3 * statistics.median(values)

    fields = {f"{name}_ms": median_ms([stage.get(name) for _, _, stage in runs])
              for name in ("text_encode", "vae_decode")}
    fields["transformer_ms"] = 1e3 * statistics.median([t for _, t, _ in runs])
    fields["other_ms"] = median_ms([latency - t - (stage.get("text_encode") or 0.0) - (stage.get("vae_decode") or 0.0)
                                    for latency, t, stage in runs])
    return fields


def measure(b: Bench, contender: Contender, reference: np.ndarray | None) -> tuple[dict, np.ndarray | None]:
    """One round of a contender as its row (apply, warm up, time every prompt, undo). Returns the row and
    the first prompt's output."""
    result, problems = measure_round(b, contender)
    row = _row(contender, "failed") if result is None else rounds_row(contender, [result], reference, b.steps)
    row.update(problems)
    row.update(_info_fields(contender))
    return row, None if result is None else result.first_output


def precheck(b: Bench, contender: Contender, baseline_row: dict | None,
             rows: list[dict] = ()) -> tuple[str | None, str | None]:
    """(status, reason) of a contender that will not be measured ("skipped": not requested or no time left,
    "cannot run": what it detected), or (None, None); the same on every rank. The time it needs: the larger of
    the baseline's estimate (`estimate_cost_s`) and what the measured `rows` of its compile setting cost
    (`observed_cost_s`)."""
    reason = contender.info.get("skip_reason")
    status = "skipped" if reason else None
    if status is None:
        reason = _agree(b, contender.check(b))
        status = "cannot run" if reason else None
    if status is None and contender.name != BASELINE:
        costs = [c for c in (estimate_cost_s(b, contender, baseline_row), observed_cost_s(b, contender, list(rows)))
                 if c is not None]
        cost = max(costs) if costs else None
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
