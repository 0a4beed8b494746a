"""The ingress's /metrics: every replica's own metrics in one Prometheus text, each sample labelled with
the replica it came from (`replica="ID"`), each family once."""

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["merge_metrics"]


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge_metrics(texts: Mapping[str, str]) -> bytes:
    """One exposition of the replicas' expositions, `texts` keyed by replica id."""
    families: dict[str, Metric] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            for sample in family.samples:
                merged.add_sample(
                    sample.name, {**sample.labels, "replica": replica}, sample.value, sample.timestamp
                )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)
