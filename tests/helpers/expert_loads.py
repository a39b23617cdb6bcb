"""Observe what an expert-sharded load creates and reads, from outside the loader (no counters in it).

    with count_expert_loads() as seen:
        load_transformer("tiny-hidream", expert_shard=(1, 2))
    seen["expert_bytes"], seen["expert_tensors_read"]

expert_bytes: bytes of the expert tensors the per-family random init returned (built-in models) plus those
read from safetensors files (local folders); expert_tensors_read: expert tensors or slices read from the
files. Both wrap the loader's two sources: each family record's ``experts.random_experts`` and the safetensors
reader.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from unittest import mock


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@contextmanager
def count_expert_loads():
    from xstage_dit.families import experts
    from xstage_dit.families.registry import records

    seen = {"expert_bytes": 0, "expert_tensors_read": 0}

    def counting_random(fn):
        def random_experts(*args, **kwargs):
            gate_up, down = fn(*args, **kwargs)
            seen["expert_bytes"] += _nbytes(gate_up, down)
            return gate_up, down

        return random_experts

    reader = experts._SafetensorsReader
    real_read, real_slice = reader.read, reader.read_slice

    def read(self, key):
        t = real_read(self, key)
        if ".experts." in key:
            seen["expert_tensors_read"] += 1
            seen["expert_bytes"] += _nbytes(t)
        return t

    def read_slice(self, key, lo, hi):
        t = real_slice(self, key, lo, hi)
        seen["expert_tensors_read"] += 1
        seen["expert_bytes"] += _nbytes(t)
        return t

    known = records()  # the families' ExpertFacts are read from here on every load (`experts.family_of`)
    counting = {name: dataclasses.replace(r, experts=dataclasses.replace(
                    r.experts, random_experts=counting_random(r.experts.random_experts)))
                for name, r in known.items() if r.experts is not None}
    with mock.patch.dict(known, counting), mock.patch.object(reader, "read", read), \
            mock.patch.object(reader, "read_slice", read_slice):
        yield seen
