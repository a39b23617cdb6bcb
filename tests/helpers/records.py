"""Change a family record's feature facts for one test: every lookup (`registry.record_for_transformer`, ...)
reads the registry's dict of records, so replacing an entry with ``monkeypatch`` changes what the features see
and is undone after the test.

    with_facts(monkeypatch, "nucleusmoe", cfg_batch_output_like=None)
"""

from __future__ import annotations

import dataclasses


def with_facts(monkeypatch, family: str, **facts) -> None:
    """Replace `family`'s record by one whose ``facts`` have `facts` changed (``FeatureFacts`` fields)."""
    from xstage_dit.families.registry import records

    known = records()
    record = known[family]
    monkeypatch.setitem(known, family, dataclasses.replace(record, facts=dataclasses.replace(record.facts, **facts)))
