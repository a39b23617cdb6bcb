"""`StopVote`: every rank stops a batch at the same step, and no step waits on the control channel.

Cancellation (a client cancelled, a deadline passed) is decided on rank 0, but every rank must leave the
pipeline at the same step or the data collectives of the next step would hang. Instead of a blocking
broadcast after every step, each rank starts, every ``period`` steps, a non-blocking MAX all-reduce of its
stop flag (rank 0 contributes its decision, the others 0) over the gloo control group, and reads the
result of the *previous* vote, which has had ``period`` steps (hundreds of milliseconds) to arrive: the
``wait()`` returns at once. All ranks see the same sequence of results, so all stop at the same step,
at most ``2 * period`` steps after rank 0 decided.

Example::

    vote = StopVote(reducer(group), period=1)
    for step in range(1, steps + 1):
        ...                                # the step's GPU work, queued
        if vote.step(step, want_stop=rank0_says_stop):
            raise BatchStopped(step)
    vote.finish()                          # the last vote, long complete
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch


def reducer(group: Any) -> Callable[[torch.Tensor], Any]:
    """The production reduction: a non-blocking MAX all-reduce over `group` (returns the Work)."""
    import torch.distributed as dist

    return functools.partial(dist.all_reduce, op=dist.ReduceOp.MAX, group=group, async_op=True)


class StopVote:
    """reduce: starts a reduction of a (1,) int32 CPU tensor in place and returns an object with wait().
    period: steps between votes (>= 1)."""

    def __init__(self, reduce: Callable[[torch.Tensor], Any], period: int = 1):
        if not isinstance(period, int) or period < 1:
            raise ValueError(f"expected a stop-vote period of >= 1 steps, got {period!r}")
        self.reduce = reduce
        self.period = period
        self._work: Any = None
        self._flag: Any = None  # numpy view of the tensor being reduced: read without a torch call

    def step(self, step: int, want_stop: bool) -> bool:
        """After step `step`: True when the ranks agreed (one vote earlier) to stop here."""
        if step % self.period:
            return False
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._flag[0]:
                return True
        tensor = torch.tensor([1 if want_stop else 0], dtype=torch.int32)
        self._flag = tensor.numpy()
        self._work = self.reduce(tensor)
        return False

    def finish(self) -> None:
        """The batch ended normally: complete the last vote (every rank started the same ones)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
