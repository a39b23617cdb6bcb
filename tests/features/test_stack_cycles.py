"""Must-show of issue 38: apply and restore the whole stack 20 times on one pipeline in one process.

The tiny NucleusMoE (CPU, bfloat16: Dynamo's fake grouped_mm takes bf16 only) has something for every feature:
MoE layers (expert parallel at world 1, the compile fixes), a rope with host copies (host syncs), CFG that
batches, an LLM text encoder read at an inner layer (text depth), an empty negative prompt (prompt cache), a
video VAE decoding one frame (one-frame VAE), an image kind (batch invariance), and compile last: regional, with
the "eager" backend (Dynamo traces, guards and caches real graphs, which is what restore must drop; Inductor's
code generation would add minutes per cycle on the 2-core CPU machine and changes nothing restore sees). After
each restore: the images bit-identical to the untouched pipeline's, the process's resident memory (after a
garbage collection) within 5 % of where it started, and a second pipeline, compiled by its own engine before
the cycles began, still answering from its graphs (no frame converted: Dynamo's counters through
`_torch_private`) with the same images.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from xstage_dit import _torch_private as tp
from xstage_dit.engine import Engine, EngineConfig
from xstage_dit.features.compile import CompileConfig
from xstage_dit.features.config import ParallelConfig
from xstage_dit.features.context import MARK
from tests.helpers.server import one_torch_thread
from tests.helpers.stack_cycles import RSS_TOLERANCE, images as _images, rss_bytes as _rss_bytes

CYCLES = 20


def _instance_state(pipe) -> dict:
    """Every instance attribute a patch could leave on the pipeline's modules (forwards, processors, hooks)."""
    state = {}
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            for path, module in component.named_modules():
                state[(name, path)] = (type(module), sorted(k for k in vars(module) if not k.startswith("_") or
                                                            k in ("_diffusers_hook", "_compiled_call_impl")),
                                       getattr(module, "processor", None))
    return state


@pytest.mark.slow
def test_the_whole_stack_applied_and_restored_20_times_leaves_the_process_as_found(monkeypatch):
    from diffusers.models.attention_dispatch import AttentionBackendName

    # Under pytest, torch's structured trace logger carries pytest's capturing handlers, so every compile emits
    # DEBUG records that pytest keeps for the whole test: memory of the harness, not of the process under test.
    # Without handlers torch skips those records, as it does outside pytest unless TORCH_TRACE is set.
    monkeypatch.setattr(logging.getLogger("torch.__trace"), "handlers", [])

    from xstage_dit.families import load_pipeline, model_spec

    spec = model_spec("tiny-nucleusmoe")
    config = EngineConfig(device="cpu", dtype=torch.bfloat16, parallel=ParallelConfig(cfg_batch="auto"),
                          compile=CompileConfig("regional", backend="eager"), batch_invariance=True)
    with one_torch_thread():
        pipe = load_pipeline("tiny-nucleusmoe", dtype=torch.bfloat16, device="cpu", seed=0)
        other = load_pipeline("tiny-nucleusmoe", dtype=torch.bfloat16, device="cpu", seed=1)
        members = list(AttentionBackendName)
        untouched, state = _images(pipe, spec), _instance_state(pipe)
        # The second pipeline without batch invariance: on the CPU its trimmed text attention breaks the graph
        # (a data-dependent length), and graphs below a break sit on shared code objects (the block's forward),
        # where two owners' entries can only be invalidated, not removed (`OwnedCompiler._drop_shared`).
        second = Engine(dataclasses.replace(config, batch_invariance=False))
        second.apply(other, kind="image")
        try:
            other_images = _images(other, spec)  # compiles the second pipeline's graphs
            assert tp.frames_converted() > 0
            first = Engine(config)
            first.apply(pipe, kind="image")
            _images(pipe, spec)
            first.restore()  # one cycle before measuring: imports and allocator pools settle
            baseline, rss = _rss_bytes(), []
            for cycle in range(CYCLES):
                engine = Engine(config)
                stack = engine.apply(pipe, kind="image")
                assert stack.applied[-1] == "compile" and "batch_invariance" in stack.applied
                applied = _images(pipe, spec)
                assert applied.shape == untouched.shape and stack.compiled.compiled_shapes
                engine.restore()
                assert torch.equal(_images(pipe, spec), untouched), f"cycle {cycle}: not the untouched images"
                assert _instance_state(pipe) == state and not hasattr(pipe.transformer, MARK)
                rss.append(_rss_bytes())
                assert rss[-1] <= baseline * (1 + RSS_TOLERANCE), (
                    f"cycle {cycle}: resident memory {rss[-1] / 2**20:.1f} MiB against {baseline / 2**20:.1f} MiB "
                    f"before the cycles (more than {RSS_TOLERANCE:.0%}); per cycle: {[r // 2**20 for r in rss]}")
            print(f"resident memory before the cycles {baseline / 2**20:.1f} MiB, after each restore (MiB): "
                  f"{[round(r / 2**20, 1) for r in rss]}")
            before = tp.frames_converted()
            assert torch.equal(_images(other, spec), other_images)
            assert tp.frames_converted() == before, "the second pipeline recompiled: its graphs were dropped"
        finally:
            second.restore()
    assert list(AttentionBackendName) == members  # the last user gone: the member too
