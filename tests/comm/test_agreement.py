"""`xstage_dit.comm.agreement` in one process (world 1: nothing exchanged); the multi-rank behaviour
(same error on every rank within 10 s) is tested end to end in tests/patches/test_families.py."""

from __future__ import annotations

import pytest
import torch

from xstage_dit.comm import agreement


def test_world1_checks_and_blocks_pass_through():
    agreement.check_agreement({"config": 1})  # no process group: nothing to compare
    with pytest.raises(KeyError):  # the local exception, unchanged
        with agreement.fail_together():
            raise KeyError("local")


def test_failures_keep_their_builtin_kind():
    err = agreement._failure("ValueError", "parallelize failed on rank 1 of 2: ValueError: bad sp")
    assert isinstance(err, agreement.RankFailed) and isinstance(err, ValueError)
    assert type(agreement._failure("ValueError", "x")) is type(err)  # one class per kind
    assert type(agreement._failure("MyError", "x")) is agreement.RankFailed  # not a builtin: plain RankFailed
    assert type(agreement._failure("RuntimeError", "x")) is agreement.RankFailed


def test_fingerprint_tells_inputs_apart_and_is_deterministic():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 16, generator=g)
    a = agreement.fingerprint({"hidden_states": x, "timestep": torch.tensor([0.5]), "steps": 4, "skip": object()})
    assert a == agreement.fingerprint({"hidden_states": x.clone(), "timestep": torch.tensor([0.5]), "steps": 4})
    assert a["hidden_states"][:2] == ((2, 9, 16), "float32") and a["steps"] == 4 and "skip" not in a
    y = x.clone()
    y[0, 0, 0] += 1e-3
    assert agreement.fingerprint({"hidden_states": y})["hidden_states"] != a["hidden_states"]
    assert agreement.fingerprint({"freqs": torch.polar(torch.ones(3), torch.arange(3.0))})["freqs"][1] == "complex64"
