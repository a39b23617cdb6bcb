"""The step-cache contenders of the end-to-end benchmark: each xstage cache method at forced ratios, and cache-dit
on plain diffusers (its default cache, and the same forced ratios).

Random weights make no trained residual curve (a measured cache decides arbitrarily on them), so speed is measured
at forced ratios: with ``--cache-contender-every 4,2`` every method computes a full step every 4th (25 %) and every
2nd (50 %) step (`StepCacheConfig.compute_every`; fastercache, which keeps its own schedule, runs its attention
interval N inside its timestep range and reports what it computed). Each row records the counts its last call
made (``step_cache``: computed and skipped steps or attention calls). cache-dit's forced variants compute the same
steps through its ``steps_computation_mask`` (static policy) with one first block computed on a cached step
(``Fn_compute_blocks=1``), the work of First Block Cache's skipped step; its default variant is
``cache_dit.enable_cache(pipe)`` as its users call it (dynamic, 8 first blocks).

Contender names: ``xstage-cache:<method>@1/<N>`` and ``cache-dit@1/<N>``, ``cache-dit`` (default).
"""

from __future__ import annotations

import torch

from xstage_dit.bench.contenders import PlainDiffusers, XStage
from xstage_dit.bench.session import Bench, error_text

__all__ = ["CacheDit", "XStageCache", "cache_entries"]

DEFAULT_METHODS = ("fbcache", "taylorseer", "magcache", "pab", "fastercache")
DEFAULT_COMPUTE_EVERY = (4, 2)  # 25 % and 50 % of the steps computed fully


def _cache_config(method: str, every: int):
    from xstage_dit.features.step_cache import StepCacheConfig

    if method == "fastercache":  # its first call inside the timestep range cannot be cached: its own schedule
        return StepCacheConfig(method, interval=every)
    return StepCacheConfig(method, compute_every=every)


class XStageCache(XStage):
    """``xstage-calibrated`` with a step cache at a forced ratio (`features.step_cache`), each call one request."""

    def __init__(self, compile: bool, method: str, every: int):
        super().__init__(compile, "auto")
        self.method, self.every = method, every
        self.family = f"xstage-cache:{method}@1/{every}"

    def _cache(self, b: Bench):
        return _cache_config(self.method, self.every)



class CacheDit(PlainDiffusers):
    """cache-dit (``pip install 'xstage-dit[bench]'``) on the unmodified diffusers pipeline: its default cache
    (``every`` None) or a forced mask computing every ``every``-th step fully."""

    compile_vae = False

    def __init__(self, compile: bool, every: int | None):
        super().__init__(compile)
        self.every = every
        self.family = "cache-dit" if every is None else f"cache-dit@1/{every}"

    def check(self, b: Bench) -> str | None:
        try:
            import cache_dit
        except ImportError as exc:
            return f"cache-dit is not installed ({error_text(exc)}): pip install 'xstage-dit[bench]'"
        if b.world_size > 1:
            return "cache-dit on plain diffusers runs one GPU here (its own parallelism is another contender)"
        # The longest block list (FLUX's transformer_blocks, Wan's blocks, ...): what cache-dit's adapter caches.
        blocks = max((len(m) for m in b.pipe.transformer.children() if isinstance(m, torch.nn.ModuleList)),
                     default=0)
        if self.every is None and blocks < 8:
            return (f"cache-dit {cache_dit.__version__}'s default cache computes the first 8 blocks of a cached step "
                    f"(Fn_compute_blocks=8); {type(b.pipe.transformer).__name__} has {blocks}")
        return None

    def apply(self, b: Bench) -> None:
        import cache_dit

        if self.every is None:
            cache_dit.enable_cache(b.pipe)
        else:
            mask = [1 if step % self.every == 0 else 0 for step in range(b.steps)]
            cache_dit.enable_cache(b.pipe, cache_config=cache_dit.DBCacheConfig(
                steps_computation_mask=mask, steps_computation_policy="static", num_inference_steps=b.steps,
                Fn_compute_blocks=1, Bn_compute_blocks=0))
        self.info["cache_dit_version"] = cache_dit.__version__
        super().apply(b)

    def call(self, b: Bench, kwargs: dict):
        import cache_dit

        out = b.pipe(**kwargs)
        stats = cache_dit.summary(b.pipe, logging=False)
        cached = max((len(s.cached_steps) for s in stats), default=0)
        self.info["step_cache"] = {"method": self.family, "unit": "steps",
                                   "computed": kwargs["num_inference_steps"] - cached, "skipped": cached}
        return out

    def restore(self, b: Bench) -> None:
        super().restore(b)
        import cache_dit

        cache_dit.disable_cache(b.pipe)


def cache_entries(name: str, methods: tuple[str, ...], compute_every: tuple[int, ...]) -> list[tuple[str, object]]:
    """The (family name, factory(compile) -> contender) pairs a cache contender name stands for."""
    if name == "xstage-cache":
        return [(f"xstage-cache:{m}@1/{n}", lambda c, m=m, n=n: XStageCache(c, m, n))
                for n in compute_every for m in methods]
    if name == "cache-dit":
        return [("cache-dit", lambda c: CacheDit(c, None))] + [
            (f"cache-dit@1/{n}", lambda c, n=n: CacheDit(c, n)) for n in compute_every]
    raise ValueError(f"expected xstage-cache or cache-dit, got {name!r}")
