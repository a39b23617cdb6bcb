"""The attention schedule of every layer shape of one ``parallelize`` call, decided once per shape.

``parallelize`` resolves the calibrated params once (`calibration.params_for`) and builds one
`AttentionSchedules`; every attention context of the call shares it. For "auto", the first call of a shape
asks the `KernelChooser` (`attention_kernels`: the machine's kernel sweep) for the kernel, then
`ops.attention.auto.resolve_attention_decision` (the X-Stage design test; at world 1 the comparison with
torch SDPA) for the schedule, "fused:<kernel>" or "serial"; it records the `AttentionDecision` in ``choices``
(the handle's ``schedule_choices``) and logs both reasons, once; later calls, eager or compiled, read it.

Under ``torch.compile`` the decision runs as ``torch.compiler.assume_constant_result``: Dynamo calls it
at trace time with the same values eager code passes (so the same choice, from the same place, logged
once) and bakes the returned name into the graph, guarding on nothing but the shape. The same holds for
``paths``, the attention paths taken (first module per path), logged once each.
"""

from __future__ import annotations

import logging

import torch

from xstage_dit.features.attention_kernels import KernelChooser
from xstage_dit.features.config import ParallelConfig
from xstage_dit.features.context import FeatureContext
from xstage_dit.ops.attention.auto import resolve_attention_decision
from xstage_dit.schedule.facts import DeviceFacts

log = logging.getLogger(__name__)

__all__ = ["AttentionSchedules", "ATTENTION_PATHS", "apply"]

# "ulysses" = the op, "local" = no exchange (diffusers' own SDPA call), "gather_kv" = the fallback.
ATTENTION_PATHS = ("ulysses", "local", "gather_kv")


class AttentionSchedules:
    """schedule: "auto" | "fused" | "serial" (the user's). xparams / source: the calibrated params handed
    down by ``parallelize`` and where they came from (``ChosenParams.params`` / ``.source``). world: the sp
    degree. facts: the device's facts. kernels: the kernel per shape (None = a chooser that measures nothing
    and reads no cache). choices: {(batch, seq_len, heads, head_dim, dtype, world): AttentionDecision}, filled
    once per shape. paths: {path: first module that took it}. masked_choices: {(batch, seq_len, heads, head_dim,
    dtype): KernelChoice} of world-1 calls with a key-padding mask (`masked_kernel`)."""

    def __init__(self, schedule: str, *, world: int, facts: DeviceFacts, xparams=None, source: str = "",
                 kernels: KernelChooser | None = None, choices: dict | None = None,
                 paths: dict | None = None, masked_choices: dict | None = None) -> None:
        if schedule not in ("auto", "fused", "serial"):
            raise ValueError(f"expected schedule 'auto', 'fused' or 'serial', got {schedule!r}")
        self.schedule, self.world, self.facts = schedule, world, facts
        self.xparams, self.source = xparams, source
        self.kernels = kernels if kernels is not None else KernelChooser(world=world, sweep=lambda *a: None)
        self.choices = {} if choices is None else choices
        self.paths = {} if paths is None else paths
        # (batch, seq_len, heads, head_dim, dtype) -> KernelChoice (`masked_kernel`), filled once per shape
        self.masked_choices = {} if masked_choices is None else masked_choices
        # Closures over this instance (a bound method cannot carry Dynamo's mark): Dynamo then calls the
        # decision at trace time with plain values only.
        def decide_once(*shape):
            return self._decide(*shape)

        def note_once(path, module):
            return self._note(path, module)

        def masked_once(*shape):
            return self._masked(*shape)

        self._decide_once = torch.compiler.assume_constant_result(decide_once)
        self._note_once = torch.compiler.assume_constant_result(note_once)
        self._masked_once = torch.compiler.assume_constant_result(masked_once)

    def for_shape(self, batch: int, seq_len: int, heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device) -> str:
        """The schedule name for q of (batch, seq_len / world, heads, head_dim) per rank: the user's, or the
        design test's, decided at the first call of this shape."""
        if self.schedule != "auto":
            return self.schedule
        return self._decide_once(int(batch), int(seq_len), int(heads), int(head_dim), dtype, device)

    def masked_kernel(self, batch: int, seq_len: int, heads: int, head_dim: int, dtype: torch.dtype,
                      device: torch.device) -> str:
        """The kernel of a world-1 call of queries (batch, seq_len, heads, head_dim) with a key-padding mask: "sdpa"
        (torch's, with the mask), "cudnn-padded" or "cudnn-fp8" (cuDNN's padding mask over per-sample key lengths;
        the FP8 one for compiled calls only): the `KernelChooser`'s masked choice, timed on masked inputs
        (`masked_sweep`), decided once per shape and logged. "sdpa" unless the schedule is "auto"."""
        if self.schedule != "auto":
            return "sdpa"
        return self._masked_once(int(batch), int(seq_len), int(heads), int(head_dim), dtype, device)

    def _masked(self, batch: int, seq_len: int, heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> str:
        key = (batch, seq_len, heads, head_dim, dtype)
        if key not in self.masked_choices:
            choice = self.kernels.choose(batch=batch, seq_len=seq_len, heads=heads, head_dim=head_dim, dtype=dtype,
                                         device=device, masked=True)
            log.info("masked attention for batch=%d seq=%d heads=%d head_dim=%d %s: %s (%s)", batch, seq_len, heads,
                     head_dim, str(dtype).replace("torch.", ""), choice.name, choice.reason)
            self.masked_choices[key] = choice
        return self.masked_choices[key].name or "sdpa"

    def note_path(self, path: str, module: str) -> bool:
        """Record (once, with a log line) that an attention module took ``path``.

        A no-op while torch.compile traces: reading the module name there guards every compiled block on its
        own name, so regional compilation (one graph for all blocks of a class) recompiled per block and ran
        eager past the recompile limit (FLUX: 162.6 vs 133.4 ms a step on the H200, 2026-12-03). The eager
        calls (warm-up, the first forward) still record every module's path."""
        if torch.compiler.is_compiling():
            return False
        return self._note_once(path, module)

    def _decide(self, batch: int, seq_len: int, heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> str:
        key = (batch, seq_len, heads, head_dim, dtype, self.world)
        decided = self.choices.get(key)
        if decided is not None:
            return decided.name
        kernel = self.kernels.choose(batch=batch, seq_len=seq_len, heads=heads, head_dim=head_dim, dtype=dtype,
                                     device=device)
        decision = resolve_attention_decision(self.xparams, kernel, batch=batch, seq_len=seq_len, heads=heads,
                                              head_dim=head_dim, world_size=self.world, dtype=dtype, device=device,
                                              facts=self.facts)
        log.info("attention schedule for batch=%d seq=%d heads=%d head_dim=%d %s world=%d: %s (%s; params: %s); "
                 "kernel %s (%s)", batch, seq_len, heads, head_dim, str(dtype).replace("torch.", ""), self.world,
                 decision.name, decision.reason, self.source or "none", decision.kernel, decision.kernel_reason)
        self.choices[key] = decision
        return decision.name

    def _note(self, path: str, module: str) -> bool:
        if path not in ATTENTION_PATHS:
            raise ValueError(f"expected an attention path in {ATTENTION_PATHS}, got {path!r}")
        if path not in self.paths:
            self.paths[path] = module
            log.info("attention path %s: first taken by %s", path, module or "?")
        return True


def apply(pipe, config: ParallelConfig, ctx: FeatureContext) -> None:
    """The stack's attention-kernel choice: the `KernelChooser` (schedule "auto": the machine's kernel sweep) in
    ``ctx.attention_kernels`` and the per-shape `AttentionSchedules` the sequence-parallel backend reads in
    ``ctx.schedules`` (decisions recorded in ``ctx.schedule_choices`` / ``ctx.attention_paths``). Nothing to
    undo: both act only through the attention contexts that sequence parallelism installs."""
    groups, chosen = ctx.groups, ctx.calibration
    if config.schedule == "auto":
        ctx.attention_kernels = KernelChooser(world=config.sp, group=groups.sp_group, allow_measure=config.calibrate)
    ctx.schedules = AttentionSchedules(config.schedule, world=config.sp, facts=DeviceFacts.from_device(groups.device),
                                       xparams=chosen.params if chosen else None, source=chosen.source if chosen else "",
                                       kernels=ctx.attention_kernels, choices=ctx.schedule_choices,
                                       paths=ctx.attention_paths, masked_choices=ctx.masked_choices)
    return None
