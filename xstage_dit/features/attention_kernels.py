"""Which kernel runs one attention shape of a ``parallelize`` call: the machine's kernel sweep (timed once,
cached beside the calibration: ``calibration.kernel_sweep``) read by ``schedule.attention_kernel``.

    chooser = KernelChooser(world=4, group=sp_group, device=torch.device("cuda", 0), allow_measure=True)
    choice = chooser.choose(batch=1, seq_len=32760, heads=40, head_dim=128, dtype=torch.bfloat16,
                            device=torch.device("cuda", 0))          # KernelChoice("fa4", "fastest measured ...")

Candidates (``ops.attention.window_path.problem_refusals``): at world 1 torch SDPA as diffusers calls it
("sdpa", the baseline: kept unless another kernel measured faster at the same shape), FA4 plain and cuDNN's
kernel through torch's cuDNN backend; at world > 1 the kernels that write the post-A2A through the peer window
(FA4, cuDNN-frontend, our Triton kernel). The sweep runs only where two or more candidates take the shape on a
CUDA device: without a GPU nothing is timed, and at world > 1 without flash-attn-4 and cudnn-frontend the
choice is what it was before the sweep existed (our Triton kernel with the design test's assumed speed).

When it measures: at the first decision of a shape (``AttentionSchedules`` asks once per shape), which is
either the first eager call or, when the first call is compiled, Dynamo's trace-time call of the
``assume_constant_result`` decision. Dynamo runs that function for real: no fake-tensor or other dispatch
mode is active inside it, so the timing closures launch real kernels on real tensors (checked on the CPU by
tests/features/test_attention_kernel_choice.py). Measuring there rather than in ``parallelize`` is forced:
the token count (hence the shape family) is known only at the first call. A sweep is never run while a CUDA
graph is being captured (cache only then). Either way the choice is a pure function of the cached timings,
so eager and compiled calls of one shape choose the same.

Ranks agree: at world > 1 the sp group's first rank chooses (loads or measures its family) and broadcasts
the ``KernelChoice``; every rank runs what it sent. Choosing per rank from its own timings could pick
"fused:fa4" on one rank and "serial" on another, whose collectives never pair: a hang. A failure on the
first rank is broadcast too and raised on every rank.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from xstage_dit.calibration import kernel_sweep as ks
from xstage_dit.ops.attention.kernels import kernel_versions
from xstage_dit.ops.attention.window_path import problem_family, problem_refusals, sweep_cases
from xstage_dit.schedule.attention_kernel import (DEFAULT_ORDER, FP8_ATTENTION, FP8_KERNELS, MASKED_KERNELS,
                                                  WORLD1_ORDER, BASELINE, KernelChoice, as_compiled,
                                                  choose_attention_kernel, with_fp8)

log = logging.getLogger(__name__)

# Window kernels that a CUDA-graph capture cannot record reliably: cudnn-frontend's graph failed inside the
# capture ("operation failed due to a previous error during capture") for 32K x 40 heads / P = 8 on the H200 at
# b3a1445, for 4608 x 40 / P = 8 before, and for 4608 x 40 / P = 2 (local O) on an H100 at c5f5f69, after the
# capture moved onto the stream the graph was warmed on: not a capture-stream mistake of ours
# (benchmarks/results/attention/NOTES.md). Eager runs of the same plans pass.
CAPTURE_UNSAFE = {"cudnn": "cudnn-frontend's graphs failed inside CUDA-graph captures on the H200 (b3a1445) and "
                           "the H100 (c5f5f69): not under --compile graphs"}
# cudnn-fp8 runs cudnn-frontend's graphs at every world size (at world 1 too: torch has no FP8 SDPA backend).
CAPTURE_UNSAFE_ANY_WORLD = {name: "cudnn-frontend's graphs failed inside CUDA-graph captures (see cudnn): not under "
                                  "--compile graphs" for name in ("cudnn-fp8", "cudnn-padded")}
# The 16-bit dtypes the 8-bit kernels quantize from.
FP8_INPUT_DTYPES = (torch.bfloat16, torch.float16)

__all__ = ["KernelChooser"]

# (problem dict, family, allow_measure) -> the sweep holding the family's timings, or None (nothing cached)
Sweep = Callable[[dict, str, bool], "ks.KernelSweep | None"]
Refusals = Callable[..., "dict[str, str | None]"]


class KernelChooser:
    """The kernel per attention shape for the ranks of one sp group.

    world: the sp degree; group: the sp group (None at world 1); allow_measure: time a family missing from
    the cache (``ParallelConfig.calibrate``), else read the cache only. sweep / refusals: where timings and
    the candidates' answers come from (default: this machine's cached or measured sweep and
    ``problem_refusals``; tests hand in fakes). report(): what was measured or loaded, for ``/v1/calibration``.
    """

    def __init__(self, *, world: int, group=None, allow_measure: bool = False, sweep: Sweep | None = None,
                 refusals: Refusals | None = None, cache_dir: str | os.PathLike | None = None) -> None:
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"expected world to be an int >= 1, got {world!r}")
        self.world, self.group, self.allow_measure = world, group, allow_measure
        self.cache_dir = cache_dir
        self._sweep = sweep if sweep is not None else self._machine_sweep
        self._refusals = refusals
        self._sweeps: dict[str, dict] = {}  # family -> {"timings_ms", "source", "path"} (report)
        self._errors: dict[str, str] = {}
        self.capture_refusals: dict[str, str] = {}  # kernel -> why not, while calls run under CUDA graphs
        self.fp8_attention = "off"  # `use_fp8_attention`
        self.compiled = False  # `for_compile`: kernels timed in their compiled form are chosen by that time
        self.qk_bounded: bool | None = None  # `note_qk_bounds`: every attention layer's q and k bounds known

    def for_cuda_graphs(self) -> Callable[[], None]:
        """Refuse, from now on, the kernels that failed inside a CUDA-graph capture (``apply_compile(mode=
        "graphs")`` records the forward); returns the undo. Shapes chosen before keep their choice."""
        # at world 1 "cudnn" is torch's cuDNN SDPA backend, captured by torch itself
        self.capture_refusals = {**(CAPTURE_UNSAFE if self.world > 1 else {}), **CAPTURE_UNSAFE_ANY_WORLD}

        def undo() -> None:
            self.capture_refusals = {}

        return undo

    def note_qk_bounds(self, bounded: bool) -> None:
        """Whether the attention layers of one patched transformer all have q and k bounds known in advance
        (``features.qk_bounds``); with several transformers, true only where every one said so. World 1's compiled
        cudnn-fp8 is then timed with them (its "-qkb" sweep family)."""
        self.qk_bounded = bool(bounded) if self.qk_bounded is None else self.qk_bounded and bool(bounded)

    def for_compile(self) -> Callable[[], None]:
        """The layers run compiled from now on (``apply_compile``): a kernel the sweep also timed compiled
        ("<kernel>+compiled", world 1's cudnn-fp8) is chosen by that time. Returns the undo. Shapes chosen
        before keep their choice."""
        self.compiled = True

        def undo() -> None:
            self.compiled = False

        return undo

    def use_fp8_attention(self, mode: str) -> Callable[[], None]:
        """From now on, the 8-bit kernels (``FP8_KERNELS``) are candidates of every bf16/fp16 shape decided: "auto"
        (timed in the shape's "-fp8" sweep family beside the 16-bit kernels, chosen where measured fastest), or one
        of them by name (that kernel wherever it takes the shape, without timing); "off": none. Returns the undo
        (mode "off" again). Set before the first shape is decided (``features.fp8`` does, at apply time)."""
        if mode not in FP8_ATTENTION:
            raise ValueError(f"expected fp8 attention in {', '.join(FP8_ATTENTION)}, got {mode!r}")
        self.fp8_attention = mode

        def undo() -> None:
            self.fp8_attention = "off"

        return undo

    @property
    def collective(self) -> bool:
        """True where the choice is made on the group's first rank and broadcast (the same on every rank)."""
        return self.world > 1 and self.group is not None and dist.is_initialized()

    def choose(self, *, batch: int, seq_len: int, heads: int, head_dim: int, dtype: torch.dtype,
               device: torch.device, masked: bool = False) -> KernelChoice:
        """The kernel for q of (batch, seq_len / world, heads, head_dim) per rank (collective at world > 1:
        every rank of the group calls it for the same shape, in the same order). masked: for world-1 calls with a
        key-padding mask, compiled (`_choose_masked`)."""
        problem = dict(batch=batch, seq_len=seq_len, heads=heads, head_dim=head_dim, world_size=self.world,
                       dtype=dtype, device=torch.device(device), masked=bool(masked))
        if not self.collective:
            return self._choose_here(problem)
        payload: list[Any] = [None]
        if dist.get_rank(self.group) == 0:
            try:
                payload = [("ok", self._choose_here(problem))]
            except Exception as exc:  # noqa: BLE001 - raised on every rank below, never left at the broadcast
                payload = [("error", f"{type(exc).__name__}: {exc}")]
        dist.broadcast_object_list(payload, src=dist.get_global_rank(self.group, 0), group=self.group)
        status, value = payload[0]
        if status != "ok":
            raise RuntimeError(f"attention kernel choice failed on the sp group's first rank: {value}")
        return value

    def _choose_here(self, problem: dict) -> KernelChoice:
        if self.world == 1:
            # One kernel for every batch size of a shape: a batch of images must attend as each image alone does
            # (the server batches only where a batched image is byte-identical to its single run), and a kernel
            # picked per batch size would break that. The one-image shape is timed and decides for all.
            problem = {**problem, "batch": 1}
        if problem.get("masked"):
            return self._choose_masked(problem)
        args = {k: problem[k] for k in ("batch", "seq_len", "heads", "head_dim", "world_size", "dtype")}
        fp8 = self.fp8_attention != "off" and problem["dtype"] in FP8_INPUT_DTYPES
        refusals = (self._refusals or problem_refusals)(**args, device=problem["device"], **({"fp8": True} if fp8
                                                                                             else {}))
        refusals = {k: self.capture_refusals.get(k) if r is None else r for k, r in refusals.items()}
        if fp8 and self.fp8_attention in FP8_KERNELS and refusals.get(self.fp8_attention, "not offered") is None:
            return KernelChoice(self.fp8_attention, f"asked for by fp8 attention {self.fp8_attention!r}", {},
                                {k: r for k, r in refusals.items() if r}, forced=True)
        takers = [k for k, r in refusals.items() if r is None]
        timings = None
        # Something to compare only where two candidates take the shape (never on a CPU: the stock kernels
        # refuse it there, and torch SDPA or our Triton kernel is all that is left).
        if len(takers) >= 2:
            bounded = fp8 and self.world == 1 and bool(self.qk_bounded)
            family = problem_family(**args, fp8=fp8, qk_bounded=bounded)
            # No sweep inside a CUDA graph capture (it synchronizes): the cache only.
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            measure = self.allow_measure and not capturing
            timings = self._timings({**problem, "fp8": fp8, "qk_bounded": bounded}, family, measure)
            timings = as_compiled(timings) if self.compiled else timings
        order, baseline = (WORLD1_ORDER, BASELINE) if self.world == 1 else (DEFAULT_ORDER, None)
        return choose_attention_kernel(timings, refusals, with_fp8(order) if fp8 else order, baseline=baseline)

    def _choose_masked(self, problem: dict) -> KernelChoice:
        """World 1, a key-padding mask: torch SDPA with the mask ("sdpa"), cuDNN's 16-bit kernel with per-sample key
        lengths ("cudnn-padded") or, with FP8 attention "auto" (compiled calls only), its FP8 kernel with them
        ("cudnn-fp8"), by the "-masked" family's timings (`masked_sweep`); "cudnn-fp8" by name wherever it takes
        the shape."""
        from xstage_dit.ops.attention import cudnn_padded

        args = {k: problem[k] for k in ("batch", "seq_len", "heads", "head_dim", "world_size", "dtype")}
        if self.world != 1:
            return KernelChoice(BASELINE, f"a masked call at world {self.world}: the gather-KV path", {}, {})
        fp8_kernel = MASKED_KERNELS[2]
        fp8 = self.fp8_attention in ("auto", fp8_kernel) and problem["dtype"] in FP8_INPUT_DTYPES
        refusals = {BASELINE: None, MASKED_KERNELS[1]: cudnn_padded.unavailable(problem["device"], args["head_dim"],
                                                                                args["dtype"])}
        if fp8:
            offered = (self._refusals or problem_refusals)(**args, device=problem["device"], fp8=True)
            refusals[fp8_kernel] = offered.get(fp8_kernel, "not offered")
        refusals = {k: self.capture_refusals.get(k) if r is None else r for k, r in refusals.items()}
        if self.fp8_attention == fp8_kernel and refusals.get(fp8_kernel, "not offered") is None:
            return KernelChoice(fp8_kernel, f"asked for by fp8 attention {fp8_kernel!r} (a masked call)", {},
                                {k: r for k, r in refusals.items() if r}, forced=True)
        timings = None
        if sum(r is None for r in refusals.values()) >= 2:  # as `_choose_here`: something to compare
            bounded = fp8 and bool(self.qk_bounded)
            family = problem_family(**args, fp8=fp8, qk_bounded=bounded, masked=True)
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            timings = as_compiled(self._timings({**problem, "fp8": fp8, "qk_bounded": bounded}, family,
                                                self.allow_measure and not capturing))
        return choose_attention_kernel(timings, refusals, tuple(k for k in MASKED_KERNELS if k in refusals),
                                       baseline=BASELINE)

    def _timings(self, problem: dict, family: str, measure: bool) -> dict | None:
        if family in self._sweeps:
            return self._sweeps[family]["timings_ms"]
        try:
            sweep = self._sweep(problem, family, measure)
        except Exception as exc:  # noqa: BLE001 - a sweep that cannot run leaves the shape unmeasured, logged
            log.warning("kernel sweep for %s failed, choosing without timings: %s: %s", family, type(exc).__name__,
                        exc)
            self._errors[family] = f"{type(exc).__name__}: {exc}"[:300]
            return None
        timings = None if sweep is None else sweep.timings_ms.get(family)
        for kernel, message in ({} if sweep is None else sweep.errors.get(family, {})).items():
            log.warning("kernel sweep %s: %s failed: %s", family, kernel, message)
            self._errors[f"{family}/{kernel}"] = message
        self._sweeps[family] = {"timings_ms": timings, "source": "no cached sweep" if sweep is None else sweep.source,
                                "path": None if sweep is None else sweep.path}
        return timings

    def _machine_sweep(self, problem: dict, family: str, measure: bool) -> ks.KernelSweep | None:
        """This machine's sweep holding ``family``: the cache, or (``measure``) timed now and cached."""
        device = problem["device"]
        key = ks.sweep_key(torch.cuda.get_device_name(device), kernel_versions())
        with torch.cuda.device(device):
            if measure:
                return ks.load_or_sweep(key, lambda missing: sweep_cases([problem]), [family], ks.cuda_event_ms,
                                        cache_dir=self.cache_dir)
            return ks.load(key, self.cache_dir)

    def report(self) -> dict:
        """{"allow_measure", "families": {family: {"timings_ms", "source", "path"}}, "errors"} (JSON-able)."""
        return {"allow_measure": self.allow_measure, "families": {f: dict(v) for f, v in self._sweeps.items()},
                "errors": dict(self._errors)}

