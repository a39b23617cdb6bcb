"""What the server does with a pipeline's step cache (`xstage_dit.features.step_cache`): the served model says
which cache runs and whether a request may set its threshold (``cache_threshold``), and every request runs in its
own pipeline call (a cache's state and decisions are one request's; a batch would share them), whatever the
batching policy. Answers report each request's computed and skipped work in ``timings.step_cache``, and
``/metrics`` counts them (``xstage_step_cache_computed_total`` / ``xstage_step_cache_skipped_total``)."""

from __future__ import annotations

from dataclasses import replace

from xstage_dit.features.step_cache import handle_of
from xstage_dit.server.batching import Batcher
from xstage_dit.server.ranks import LoadedModel


def adopt_step_cache(model: LoadedModel, batcher: Batcher) -> None:
    """Where `model`'s pipeline runs a step cache: its served facts and report, and `batcher` running every request
    alone. Every rank, after loading (only rank 0's batcher decides)."""
    handle = handle_of(model.pipe)
    if handle is None:
        return
    model.served = replace(model.served, step_cache=handle.config.describe(),
                           cache_threshold=handle.config.takes_threshold)
    batcher.run_alone(f"step cache {handle.config.method}: each request runs alone (its cache state and decisions "
                      "are its own)")
    model.report["step_cache"] = handle.describe()
