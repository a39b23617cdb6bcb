"""`StepCacheConfig`: which of diffusers' step caches runs, with its parameters, validated on construction.

Each method is one of diffusers 0.42's cache hooks (``diffusers/hooks/``), configured through its own config
class (`diffusers_config`); nothing here caches anything itself:

- ``fbcache``: First Block Cache (`FirstBlockCacheConfig`). The first block always runs; when its residual
  changed by less than ``threshold`` (relative L1) since the last full step, the other blocks are skipped and
  their cached residual added. The decision is the step cache's group decision (`gate.StepGate`).
- ``taylorseer``: TaylorSeer (`TaylorSeerCacheConfig`). Attention outputs (or, ``lite``, the final projection)
  computed every ``interval`` steps after ``warmup_steps`` full ones and predicted by a Taylor expansion of
  order ``max_order`` in between.
- ``magcache``: MagCache (`MagCacheConfig`). The block stack is skipped while the accumulated error of the
  model's magnitude ratios (``mag_ratios``: "flux" = diffusers' FLUX.1 ratios, "flat" = all 1.0, or a list)
  stays within ``threshold``, at most ``max_skip`` steps in a row, never in the first ``retention`` fraction.
- ``pab``: Pyramid Attention Broadcast (`PyramidAttentionBroadcastConfig`). Self-attention outputs reused for
  ``interval - 1`` calls out of ``interval`` while the timestep is inside ``timestep_range``.
- ``fastercache``: FasterCache (`FasterCacheConfig`) in its attention mode: self-attention outputs extrapolated
  from the last two computed ones for ``interval - 1`` calls out of ``interval`` inside ``timestep_range``. Its
  unconditional-branch skip is not used: it expects one call on an (uncond, cond) batch in BCHW layout, and the
  served pipelines call the branches apart on packed tokens.

``compute_every`` (N) forces a fixed schedule instead of the measured or tuned one: a full step every N steps
(steps 0, N, 2N, ...), the others cached. For fbcache the gate decides by the step index; taylorseer's own
decision is replaced the same way; magcache gets flat ratios with ``max_skip = N - 1``; pab its interval N over
every timestep. fastercache keeps its own schedule (its first call inside the timestep range cannot be cached).
Random weights make no trained residual curve, so benchmarks measure speed at such forced ratios (N = 4: 25 % of
the steps computed fully, N = 2: 50 %), and tests compare images decided by the schedule alone.

Example::

    StepCacheConfig("fbcache", threshold=0.08)
    StepCacheConfig("taylorseer", interval=4, warmup_steps=2)
    StepCacheConfig("magcache", compute_every=4)        # forced: steps 0, 4, 8, ... computed fully
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable

__all__ = ["METHODS", "THRESHOLD_METHODS", "StepCacheConfig", "StepCacheMemory", "parse_mag_ratios",
           "parse_timestep_range"]

METHODS = ("fbcache", "taylorseer", "magcache", "pab", "fastercache")
THRESHOLD_METHODS = ("fbcache", "magcache")  # a per-request threshold means something for these
MAG_RATIO_PRESETS = ("flux", "flat")

# Each parameter and the methods it applies to (a parameter given for another method is refused, named).
PARAMETERS = {
    "threshold": THRESHOLD_METHODS,
    "compute_every": ("fbcache", "taylorseer", "magcache", "pab"),
    "interval": ("taylorseer", "pab", "fastercache"),
    "warmup_steps": ("taylorseer",),
    "max_order": ("taylorseer",),
    "lite": ("taylorseer",),
    "max_skip": ("magcache",),
    "retention": ("magcache",),
    "mag_ratios": ("magcache",),
    "timestep_range": ("pab", "fastercache"),
}
# diffusers' defaults, where a parameter is left out (None)
DEFAULTS = {
    "fbcache": {"threshold": 0.05},
    "taylorseer": {"interval": 5, "warmup_steps": 3, "max_order": 1, "lite": False},
    "magcache": {"threshold": 0.06, "max_skip": 3, "retention": 0.2, "mag_ratios": "flux"},
    "pab": {"interval": 2, "timestep_range": (100.0, 800.0)},
    "fastercache": {"interval": 2, "timestep_range": (-1.0, 681.0)},
}
FULL_RANGE = (-1.0, 1001.0)  # every timestep of a 1000-step training schedule (forced pab schedules)


def parse_mag_ratios(text: str) -> str | tuple[float, ...]:
    """"flux", "flat" or a comma-separated list of positive numbers; ValueError naming the bad value."""
    text = str(text).strip()
    if text in MAG_RATIO_PRESETS:
        return text
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"expected mag ratios 'flux', 'flat' or positive numbers 'r0,r1,...', got {text!r}")
    return values


def parse_timestep_range(text: str) -> tuple[float, float]:
    """"LO,HI" (timesteps of the 0..1000 schedule, LO < HI) as a tuple; ValueError naming the bad value."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        lo, hi = (float(p) for p in parts)
    except ValueError:
        raise ValueError(f"expected a timestep range 'LO,HI' such as '100,800', got {text!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"expected a timestep range LO < HI, got {text!r}")
    return lo, hi


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"expected cache {name} to be an integer >= 1, got {value!r}")


class StepCacheMemory(RuntimeError):
    """A cache's state would not fit in the device's free memory (TaylorSeer keeps max_order + 1 copies of every
    cached attention output per CFG branch): refused before it grows there, answered 507 by the server."""

    status = 507


@dataclass(frozen=True)
class StepCacheConfig:
    """One step cache (module docstring). Parameters left None take diffusers' defaults (`DEFAULTS`); a parameter
    that does not apply to `method` is refused (ValueError naming both).

    method: one of `METHODS`. threshold: fbcache / magcache (>= 0; fbcache skips while the change is below it, so
    0 never skips). compute_every: a forced schedule, a full step every N steps (>= 1). interval: taylorseer's
    cache interval, pab's / fastercache's attention skip range (>= 1). warmup_steps: taylorseer's full steps
    first (>= 1). max_order: taylorseer's Taylor order (>= 0). lite: taylorseer's lite mode. max_skip: magcache's
    consecutive skips (>= 0). retention: magcache's share of first steps never skipped ([0, 1]). mag_ratios:
    "flux", "flat" or a tuple of positive numbers. timestep_range: (lo, hi), pab / fastercache.
    """

    method: str
    threshold: float | None = None
    compute_every: int | None = None
    interval: int | None = None
    warmup_steps: int | None = None
    max_order: int | None = None
    lite: bool | None = None
    max_skip: int | None = None
    retention: float | None = None
    mag_ratios: str | tuple[float, ...] | None = None
    timestep_range: tuple[float, float] | None = None
    given: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"expected a cache method in {', '.join(METHODS)}, got {self.method!r}")
        given = tuple(name for name in PARAMETERS if getattr(self, name) is not None)
        for name in given:
            if self.method not in PARAMETERS[name]:
                raise ValueError(f"cache {name} applies to {', '.join(PARAMETERS[name])}, got it with method "
                                 f"{self.method!r}")
        object.__setattr__(self, "given", given)
        for name, value in DEFAULTS[self.method].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        self._check_values()
        if self.compute_every is not None and self.method == "magcache" and "mag_ratios" in given:
            raise ValueError("cache compute_every forces magcache's flat ratios: expected no mag_ratios with it, got "
                             f"{self.mag_ratios!r}")

    def _check_values(self) -> None:
        if self.threshold is not None and not (isinstance(self.threshold, (int, float)) and
                                               math.isfinite(self.threshold) and self.threshold >= 0):
            raise ValueError(f"expected cache threshold >= 0, got {self.threshold!r}")
        for name in ("compute_every", "interval"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        for name in ("warmup_steps", "max_order", "max_skip"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"expected cache {name} to be an integer >= 0, got {value!r}")
        if self.method == "taylorseer" and self.warmup_steps < 1:
            raise ValueError(f"expected cache warmup_steps >= 1 for taylorseer (its first step has nothing to predict "
                             f"from), got {self.warmup_steps}")
        if self.retention is not None and not (isinstance(self.retention, (int, float)) and 0 <= self.retention <= 1):
            raise ValueError(f"expected cache retention in [0, 1], got {self.retention!r}")
        if isinstance(self.mag_ratios, str):
            parse_mag_ratios(self.mag_ratios)
        elif self.mag_ratios is not None:
            object.__setattr__(self, "mag_ratios", parse_mag_ratios(",".join(map(str, self.mag_ratios))))
        if self.timestep_range is not None:
            object.__setattr__(self, "timestep_range", parse_timestep_range(",".join(map(str, self.timestep_range))))

    @property
    def takes_threshold(self) -> bool:
        """Whether a request may override the threshold (fbcache, magcache, without a forced schedule)."""
        return self.method in THRESHOLD_METHODS and self.compute_every is None

    def with_threshold(self, threshold: float | None) -> "StepCacheConfig":
        """This config with a request's threshold (None: unchanged); ValueError where the method has none."""
        if threshold is None:
            return self
        if not self.takes_threshold:
            why = "a forced schedule (compute_every)" if self.compute_every is not None else f"method {self.method!r}"
            raise ValueError(f"expected no cache threshold: {why} decides without one, got {threshold!r}")
        return replace(self, threshold=threshold)

    def describe(self) -> dict:
        """The method and every parameter in effect (defaults included)."""
        out = {"method": self.method}
        out.update({name: getattr(self, name) for name in PARAMETERS
                    if self.method in PARAMETERS[name] and getattr(self, name) is not None})
        return out

    def diffusers_config(self, steps: int, timestep: Callable[[], float], attentions: tuple[str, ...] = ()) -> Any:
        """diffusers' config object of this method for a call of `steps` denoising steps; `timestep` returns the
        current step's timestep as a host number (pab / fastercache read it at every attention call); `attentions`:
        the module paths of the blocks' attention layers (taylorseer's, by name: diffusers' default patterns
        ``^blocks.*attn`` miss Wan's ``attn1`` / ``attn2``)."""
        from diffusers.hooks import (FasterCacheConfig, FirstBlockCacheConfig,
                                     PyramidAttentionBroadcastConfig, TaylorSeerCacheConfig)

        if self.method == "fbcache":
            return FirstBlockCacheConfig(threshold=float(self.threshold))
        if self.method == "taylorseer":
            return TaylorSeerCacheConfig(cache_interval=self.interval, disable_cache_before_step=self.warmup_steps,
                                         max_order=self.max_order, use_lite_mode=self.lite,
                                         cache_identifiers=[re.escape(path) for path in attentions] or None)
        if self.method == "magcache":
            return self.mag_cache_config(steps)
        if self.method == "pab":
            every = self.compute_every or self.interval
            window = FULL_RANGE if self.compute_every is not None else self.timestep_range
            return PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=every,
                                                   spatial_attention_timestep_skip_range=window,
                                                   current_timestep_callback=timestep)
        return FasterCacheConfig(spatial_attention_block_skip_range=self.interval,
                                 spatial_attention_timestep_skip_range=self.timestep_range,
                                 is_guidance_distilled=True, current_timestep_callback=timestep,
                                 attention_weight_callback=lambda _module: 0.5)

    def mag_cache_config(self, steps: int) -> Any:
        """MagCache's config for a call of `steps` steps (its ratios interpolated to them, as diffusers does)."""
        from diffusers.hooks import MagCacheConfig
        from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

        if self.compute_every is not None:  # err stays 0 <= threshold: a skip until max_skip runs out
            return MagCacheConfig(threshold=0.0, max_skip_steps=self.compute_every - 1, retention_ratio=0.0,
                                  num_inference_steps=steps, mag_ratios=[1.0] * steps)
        ratios = (FLUX_MAG_RATIOS.tolist() if self.mag_ratios == "flux" else [1.0] * steps
                  if self.mag_ratios == "flat" else list(self.mag_ratios))
        return MagCacheConfig(threshold=float(self.threshold), max_skip_steps=self.max_skip,
                              retention_ratio=float(self.retention), num_inference_steps=steps, mag_ratios=ratios)
