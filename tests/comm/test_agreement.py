"""`xstage_dit.comm.agreement` in one process (world 1: nothing exchanged); the multi-rank behaviour
(same error on every rank within 10 s) is tested end to end in tests/features/test_families.py."""

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


def test_fingerprint_of_each_tensor_is_its_own_whatever_its_neighbours():
    """Stats are gathered per device and put back by index: each name keeps its own digest."""
    g = torch.Generator().manual_seed(1)
    named = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g), "c": torch.zeros(0),
             "d": torch.arange(6)}
    together = agreement.fingerprint(named)
    assert together == {k: agreement.fingerprint({k: v})[k] for k, v in named.items()}
    assert len({together[k][2] for k in "abd"}) == 3


@pytest.mark.gpu
def test_fingerprint_takes_inputs_on_several_devices():
    """Helios passes CUDA latents beside CPU frame indices (the H200 family run, 2026-12-03, failed here)."""
    if not torch.cuda.is_available():
        pytest.skip("gpu: needs a CUDA GPU, found none")
    x, idx = torch.randn(2, 8, device="cuda"), torch.arange(4)
    mixed = agreement.fingerprint({"hidden_states": x, "indices": idx})
    assert mixed == {"hidden_states": agreement.fingerprint({"hidden_states": x})["hidden_states"],
                     "indices": agreement.fingerprint({"indices": idx})["indices"]}
