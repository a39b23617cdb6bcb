"""`StepGate`: one skip-or-compute decision a denoising step, taken alike by every CFG branch and every rank.

diffusers' First Block Cache decides per call from the change of the first block's residual on the tensor that
call sees. Under sequence parallelism that is one rank's shard: one rank would skip the other blocks while
another computes them and waits in the next All-to-All forever (or, on the serial path, adds up a wrong image).
The gate replaces that decision (`decide`, bound into diffusers' hook as its decision method):

- The metric is the whole image's: each rank sums ``|r - r_prev|`` and ``|r_prev|`` over its shard (r: the first
  block's output residual, r_prev: the one of the last computed step), the ranks all-gather the sums on the device
  (`comm.staged.all_gather_dim0`, NCCL on GPUs, gloo on CPUs) and add them in rank order, so every rank holds
  the same bits. The one host read of the result is the one diffusers' hook makes anyway (its ``.item()``): no
  extra host sync a step. Skip while ``sum|r - r_prev| / sum|r_prev| < threshold`` (0 never skips).
- The conditional branch decides the step for both CFG branches ("cond leads"): its change is the one measured,
  the unconditional call follows. That is the only rule under which a step's two calls, batched into one
  (`cfg_batch`, whose batch holds cond then uncond: `PAIR_CONTEXT`, measured on its first half) or spread over
  two rank groups (CFG parallel: the cond ranks contribute, the uncond ranks add zeros), decide as one process
  does; and a step is then skipped or computed whole, which is where CFG parallel saves time. Families that
  batch the branches themselves (one call on an (uncond, cond) batch) measure the whole batch, each CFG rank
  its half.
- Which call leads comes from diffusers' cache context (the CFG hooks run each forward under the name of the
  branch it computes): "uncond" follows the decision its rank's lead took this step, or, where the lead ran on
  another rank, joins the same all-gather with zeros. Every rank therefore makes one all-gather a step (none at a
  request's first step, which always computes, or under a forced schedule, where the step index decides).
- A rank with no previous residual to compare (should not happen after the first step) raises a "compute" flag
  in the same all-gather instead of skipping alone.

Example (two ranks, threshold 0.1): rank 0's shard changed by 2 %, rank 1's by 60 %: each alone would decide
differently; both see 31 % and compute.
"""

from __future__ import annotations

import torch

from xstage_dit.comm.staged import all_gather_dim0
from xstage_dit.features.context import PAIR_CONTEXT, UNCOND_CONTEXT

__all__ = ["StepGate"]


class StepGate:
    """The decisions of one pipeline's step cache (module docstring).

    world: ranks of the pipeline (sp * cfg); group: the process group over all of them (None at world 1).
    threshold: skip while the relative change is below it. compute_every: a forced schedule (a full step every
    N steps, by the step index; no metric, no collective). `begin` starts a request (step 0, nothing pending).
    """

    def __init__(self, *, world: int = 1, group=None, threshold: float = 0.05, compute_every: int | None = None):
        if world > 1 and group is None:
            raise ValueError(f"expected a process group over the {world} ranks, got None")
        self.world, self.group = world, group
        self.threshold, self.compute_every = float(threshold), compute_every
        self.step = 0
        self.pending: bool | None = None

    def begin(self, threshold: float | None = None) -> None:
        """A new request: step 0, no decision pending, `threshold` (None: the configured one) for its steps."""
        self.step, self.pending = 0, None
        if threshold is not None:
            self.threshold = float(threshold)

    def decide(self, context: str | None, residual: torch.Tensor, previous: torch.Tensor | None) -> bool:
        """True: compute the remaining blocks. context: the call's cache-context name; residual: the first block's
        output minus its input, (batch, tokens, dim) on this rank; previous: the same at the last computed step
        of this context (None: none yet)."""
        lead = context != UNCOND_CONTEXT
        if not lead and self.pending is not None:  # this rank's cond call of the step decided already
            decision, self.pending = self.pending, None
            return decision
        step, self.step = self.step, self.step + 1
        if self.compute_every is not None:
            decision = step % self.compute_every == 0
        elif step == 0:
            decision = True
        else:
            decision = self._measured(self._sums(context, residual, previous) if lead else residual.new_zeros(
                3, dtype=torch.float64))
        if lead:
            self.pending = decision
        return decision

    @staticmethod
    def _sums(context: str | None, residual: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        """(sum |r - r_prev|, sum |r_prev|, compute flag) of this rank's part of the lead branch, float64."""
        if previous is None or previous.shape != residual.shape:
            return torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64, device=residual.device)
        if context == PAIR_CONTEXT:  # a CFG batch: cond is the first half
            half = residual.shape[0] // 2
            residual, previous = residual[:half], previous[:half]
        previous = previous.float()
        change = (residual.float() - previous).abs().sum(dtype=torch.float64)
        return torch.stack([change, previous.abs().sum(dtype=torch.float64), change.new_zeros(())])

    def _measured(self, sums: torch.Tensor) -> bool:
        """The group's decision from every rank's sums (rank order, so every rank adds the same bits)."""
        if self.world > 1:
            sums = all_gather_dim0(sums[None], self.group).sum(dim=0)
        change, reference, force = sums.tolist()  # the step's one host read (diffusers' hook makes it too)
        return force > 0 or reference <= 0 or change / reference >= self.threshold
