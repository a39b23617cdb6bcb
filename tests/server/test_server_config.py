"""ServerConfig carries the command's one ParallelConfig; the loader checks it against the ranks."""

from __future__ import annotations

import pytest

from xstage_dit.families import model_spec
from xstage_dit.features.config import ParallelConfig
from xstage_dit.server.config import ServedModel, ServerConfig
from xstage_dit.server.startup import model_loader
from xstage_dit.server.ranks import RankContext


def test_server_config_carries_one_parallel_config():
    assert ServerConfig(api_key=None).parallel == ParallelConfig()
    parallel = ParallelConfig(sp=2, cfg=2, timeout_s=30.0)
    assert ServerConfig(api_key=None, parallel=parallel).parallel is parallel
    with pytest.raises(ValueError, match=r"parallel: expected a ParallelConfig, got \(2, 1, 1\)"):
        ServerConfig(api_key=None, parallel=(2, 1, 1))


def test_loader_refuses_a_world_that_is_not_sp_times_cfg():
    load = model_loader("tiny-flux", ParallelConfig(sp=2))
    with pytest.raises(ValueError, match="expected sp \\* cfg == world size"):
        load(RankContext(world_size=1))


def test_served_model_takes_the_spec_and_its_fixed_arguments():
    spec = model_spec("tiny-wan")
    served = ServedModel.from_spec("tiny-wan", spec)
    assert (served.kind, served.size_multiple, served.default_frames, served.frame_multiple) == (
        "video", spec.patch_multiple, spec.frames, spec.frame_multiple)
    assert (served.default_width, served.default_height, served.default_steps) == (spec.width, spec.height, spec.steps)
