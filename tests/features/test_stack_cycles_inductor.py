"""Issue 38's stack cycles with Inductor itself (the whole-stack loop with Dynamo's eager backend is
tests/features/test_stack_cycles.py; a file of its own so the two long tests run on different test workers)."""

from __future__ import annotations

import logging

import pytest
import torch

from xstage_dit.engine import Engine, EngineConfig
from xstage_dit.features.compile import CompileConfig
from tests.helpers.server import one_torch_thread
from tests.helpers.stack_cycles import RSS_TOLERANCE, images as _images, rss_bytes as _rss_bytes

INDUCTOR_CYCLES = 5


@pytest.mark.slow
def test_inductor_compiles_applied_and_restored_leave_the_pipeline_and_memory_as_found(monkeypatch):
    """The same with Inductor itself, on a smaller loop (tiny FLUX, 5 cycles): its first compile takes ~45 s on the
    2-core CPU machine, later rounds hit its caches. After each restore the untouched images bit for bit and the
    resident memory within 5 % of where the first round left it."""
    from xstage_dit.families import load_pipeline, model_spec

    monkeypatch.setattr(logging.getLogger("torch.__trace"), "handlers", [])  # see the test above
    spec = model_spec("tiny-flux")
    config = EngineConfig(device="cpu", compile=CompileConfig("regional"))
    with one_torch_thread():
        pipe = load_pipeline("tiny-flux", dtype=torch.float32, device="cpu", seed=0)
        untouched = _images(pipe, spec)
        rss = []
        for cycle in range(INDUCTOR_CYCLES):
            engine = Engine(config)
            engine.apply(pipe, kind="image")
            assert engine.stack.compiled.how.startswith("regional: 2 ")
            _images(pipe, spec)
            engine.restore()
            assert torch.equal(_images(pipe, spec), untouched), f"cycle {cycle}: not the untouched images"
            rss.append(_rss_bytes())
        assert max(rss[1:]) <= rss[0] * (1 + RSS_TOLERANCE), [round(r / 2**20, 1) for r in rss]
