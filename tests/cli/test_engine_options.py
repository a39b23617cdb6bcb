"""The --no-<feature> switches of generate and serve: each turns one feature of the stack off (on by default),
and serve hands them to its rank processes."""

from __future__ import annotations

import pytest
import torch

from xstage_dit.cli import build_parser
from xstage_dit.cli.engine_options import FEATURE_FLAGS, feature_switches
from xstage_dit.engine import Engine, EngineConfig


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_each_switch_turns_its_feature_off(command):
    parser = build_parser()
    assert feature_switches(parser.parse_args([command])) == {}
    args = parser.parse_args([command, *FEATURE_FLAGS])
    switches = feature_switches(args)
    assert switches == {"host_syncs": False, "text_depth": False, "prompt_cache": False, "one_frame_vae": False}
    EngineConfig(**switches)  # every switch is an EngineConfig field


def test_serve_hands_the_switches_to_its_ranks():
    from xstage_dit.cli.serve import _argv

    args = build_parser().parse_args(["serve", "--no-prompt-cache", "--no-one-frame-vae"])
    argv = _argv(args)
    assert "--no-prompt-cache" in argv and "--no-one-frame-vae" in argv and "--no-text-depth" not in argv


def test_the_switched_off_features_are_not_applied():
    """On the tiny NucleusMoE every one of these features applies by default; switched off, none is in the stack."""
    args = build_parser().parse_args(["generate", *FEATURE_FLAGS])
    names = {"host_syncs", "text_depth", "prompt_cache", "one_frame_vae"}
    default = Engine.start(EngineConfig(model="tiny-nucleusmoe", device="cpu"))
    try:
        assert names <= set(default.stack.applied)
    finally:
        default.restore()
    off = Engine.start(EngineConfig(model="tiny-nucleusmoe", device="cpu", dtype=torch.float32,
                                    **feature_switches(args)))
    try:
        assert not names & set(off.stack.applied)
        assert off.stack.prompt_cache is None and not off.stack.text_layers_skipped and off.stack.vae_convs_2d == 0
    finally:
        off.restore()
