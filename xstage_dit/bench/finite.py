"""Whether a module's outputs stayed finite over a run, watched without a host sync per forward.

A benchmark row whose transformer output went NaN part-way still times, and times fast: on constant NaN operands an
H100's attention and GEMMs draw less power and keep higher clocks (Wan's attention 13.6 % faster,
``benchmarks/bench_data_power.py``). FP8's 0/0 on a row of zeros does that to torchao's default recipe on Wan, so
every e2e row records whether its transformer's outputs were finite, and FP8's ratios leave out a row whose were
not (`stats._fp8_ratios`)."""

from __future__ import annotations

import torch

from xstage_dit.features.cfg_parallel import _sample


class NonFiniteWatch:
    """A forward hook on `module` that folds ``~isfinite(out).all()`` of every output into one device flag (a
    reduction kernel a forward, no sync); ``seen()`` reads it once. Register it after a timer's hooks so its
    kernel runs after the timer's end event (hooks run in the order registered)."""

    def __init__(self, module: torch.nn.Module):
        self._flag: torch.Tensor | None = None
        self._handle = module.register_forward_hook(self._after)

    def _after(self, module, args, output):
        try:
            out = _sample(output)  # a transformer's output: the tensor, a tuple's first, or ``.sample``
        except (AttributeError, IndexError):  # no transformer output: nothing to watch
            return
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return
        bad = ~torch.isfinite(out).all()
        self._flag = bad if self._flag is None else self._flag | bad

    def reset(self) -> None:
        """Forget the outputs so far (the warm-up's)."""
        self._flag = None

    def seen(self) -> bool:
        """True when any output since the hook went in held a NaN or an infinity (a host sync, once)."""
        return bool(self._flag) if self._flag is not None else False

    def remove(self) -> None:
        self._handle.remove()
