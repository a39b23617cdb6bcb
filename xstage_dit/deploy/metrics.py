"""``/metrics`` of a deployment: every live replica's Prometheus metrics in one answer, each sample labelled with its
replica (``replica="<id>"``), whichever replica the scrape reached.

The replica that answers renders its own metrics and asks the others through the job directory
(`JobDirectory.gather_metrics`: each replica answers at its next poll, within a second or two); a replica that does
not answer in time is left out of that scrape. The texts are parsed and merged per metric family (the exposition
format allows one ``HELP`` / ``TYPE`` block per family), so one scrape sees, say, ``xstage_queue_depth`` of every
replica side by side.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

REPLICA_LABEL = "replica"


class _Families:
    """A collector of metric families already built (the merged ones)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return iter(self.families)


def merge(texts: dict[str, str]) -> bytes:
    """One Prometheus text of several replicas' (``{replica: text}``), every sample labelled with its replica.

    Example: ``merge({"a1": "x 1\\n", "b2": "x 2\\n"})`` holds ``x{replica="a1"} 1.0`` and ``x{replica="b2"} 2.0``.
    """
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, REPLICA_LABEL: replica}, sample.value,
                                  sample.timestamp, sample.exemplar)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)
