"""The engine's metrics as plain objects, the shape of vLLM's `LLM.get_metrics()`
(vllm.v1.metrics.reader): one Counter, Gauge or Histogram per series of the `vllm:` and
`octavo:` families in a Prometheus registry, with the series' labels.

Must not: record anything (PrometheusStatLogger does); it reads a registry at one moment.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client import Metric as PromMetric

PREFIXES = ("vllm:", "octavo:")
# The one counter family read as Vectors (vLLM's reader makes the same exception).
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Metric:
    """One series: the family's name (`vllm:prompt_tokens`, without a `_total` suffix) and its
    labels (model_name, engine, and the family's own)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A count that only goes up."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of counters: vLLM's vllm:spec_decode_num_accepted_tokens_per_pos,
    whose series (one per `position` label) are read as one list, position 0 first."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that goes up and down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets: `buckets` maps each bucket's upper bound as Prometheus writes
    it ("0.5", "+Inf") to the observations at or below it (cumulative, so "+Inf" equals
    `count`); `sum` is the observations' total."""

    count: int
    sum: float
    buckets: dict[str, int]


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every series of the registry's `vllm:` and `octavo:` families, as vLLM's reader returns
    them: counters as int Counters, gauges as Gauges, histograms with their buckets. Other
    kinds (info, summary) are left out, as vLLM leaves them."""
    collected: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(PREFIXES):
            continue
        if family.type == "gauge":
            collected.extend(
                Gauge(family.name, dict(s.labels), s.value) for s in _samples(family, "")
            )
        elif family.name == PER_POSITION:
            collected.extend(_vectors(family))
        elif family.type == "counter":
            collected.extend(
                Counter(family.name, dict(s.labels), int(s.value))
                for s in _samples(family, "_total")
            )
        elif family.type == "histogram":
            collected.extend(_histograms(family))
    return collected


def _samples(family: PromMetric, suffix: str) -> list:
    name = family.name + suffix
    return [s for s in family.samples if s.name == name]


def _vectors(family: PromMetric) -> list[Vector]:
    """One Vector per label set but `position`: the counts in position order."""
    by_labels: dict[frozenset, dict[int, int]] = {}
    for sample in _samples(family, "_total"):
        labels = dict(sample.labels)
        position = int(labels.pop("position"))
        by_labels.setdefault(frozenset(labels.items()), {})[position] = int(sample.value)
    return [
        Vector(family.name, dict(key), [counts.get(i, 0) for i in range(max(counts) + 1)])
        for key, counts in by_labels.items()
    ]


def _histograms(family: PromMetric) -> list[Histogram]:
    """One Histogram per label set: its `_bucket` samples (labelled `le`), `_count`, `_sum`."""
    by_labels: dict[frozenset, Histogram] = {}

    def histogram(labels: dict[str, str]) -> Histogram:
        key = frozenset(labels.items())
        if key not in by_labels:
            by_labels[key] = Histogram(family.name, labels, 0, 0.0, {})
        return by_labels[key]

    for sample in _samples(family, "_bucket"):
        labels = dict(sample.labels)
        bound = labels.pop("le")
        histogram(labels).buckets[bound] = int(sample.value)
    for sample in _samples(family, "_count"):
        histogram(dict(sample.labels)).count = int(sample.value)
    for sample in _samples(family, "_sum"):
        histogram(dict(sample.labels)).sum = sample.value
    return list(by_labels.values())
