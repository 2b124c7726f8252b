"""Metric families and samples, counters and histograms, and the registry that collects them.

The shapes are prometheus-client's (`Metric`'s name, documentation, type, unit and samples; a
`Sample`'s fields in its order), so that the encoders of either write the families of the
other: the tests render gpuwatch's collectors with prometheus-client's encoders, and the other
way round, and compare the bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Optional

from gpuwatch.metrics.exposition import go_string

METRIC_TYPES = ("counter", "gauge", "summary", "histogram", "gaugehistogram", "unknown",
                "info", "stateset")
INF = float("inf")


class Sample(NamedTuple):
    """One series' value. The fields after `value` are prometheus-client's; gpuwatch sets none
    of them (no timestamps, exemplars or native histograms)."""
    name: str
    labels: dict[str, str]
    value: float
    timestamp: Optional[float] = None
    exemplar: Optional[Any] = None
    native_histogram: Optional[Any] = None


class Metric:
    """A family: its name, help, type and unit, and its samples."""

    def __init__(self, name: str, documentation: str, typ: str, unit: str = "") -> None:
        if unit and not name.endswith("_" + unit):
            name += "_" + unit
        if not name:
            raise ValueError("a metric needs a name")
        self.name = name
        self.documentation = documentation
        self.unit = unit
        if typ == "untyped":
            typ = "unknown"
        if typ not in METRIC_TYPES:
            raise ValueError("Invalid metric type: " + typ)
        self.type = typ
        self.samples: list[Sample] = []

    def add_sample(self, name: str, labels: dict[str, str], value: float,
                   timestamp: Optional[float] = None, exemplar: Optional[Any] = None,
                   native_histogram: Optional[Any] = None) -> None:
        self.samples.append(Sample(name, labels, value, timestamp, exemplar, native_histogram))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Metric) and self.name == other.name
                and self.documentation == other.documentation and self.type == other.type
                and self.unit == other.unit and self.samples == other.samples)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"Metric({self.name}, {self.documentation}, {self.type}, {self.unit}, "
                f"{self.samples})")


class _Family(Metric):
    """What the families collectors build share: label names, and a value or labels."""

    def __init__(self, name: str, documentation: str, typ: str, value: Optional[Any],
                 labels: Optional[Sequence[str]], unit: str = "") -> None:
        super().__init__(name, documentation, typ, unit)
        if labels is not None and value is not None:
            raise ValueError("Can only specify at most one of value and labels.")
        self._labelnames = tuple(labels or ())


class GaugeMetricFamily(_Family):
    def __init__(self, name: str, documentation: str, value: Optional[float] = None,
                 labels: Optional[Sequence[str]] = None, unit: str = "") -> None:
        super().__init__(name, documentation, "gauge", value, labels, unit)
        if value is not None:
            self.add_metric([], value)

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        self.samples.append(Sample(self.name, dict(zip(self._labelnames, labels)), value))


class CounterMetricFamily(_Family):
    """A counter: its name without `_total`, its samples' with."""

    def __init__(self, name: str, documentation: str, value: Optional[float] = None,
                 labels: Optional[Sequence[str]] = None, unit: str = "") -> None:
        if name.endswith("_total"):
            name = name[:-6]
        super().__init__(name, documentation, "counter", value, labels, unit)
        if value is not None:
            self.add_metric([], value)

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        self.samples.append(Sample(self.name + "_total", dict(zip(self._labelnames, labels)),
                                   value))


class InfoMetricFamily(_Family):
    """An info family: one sample `<name>_info` of value 1 for each set of labels."""

    def __init__(self, name: str, documentation: str, value: Optional[dict[str, str]] = None,
                 labels: Optional[Sequence[str]] = None) -> None:
        super().__init__(name, documentation, "info", value, labels)
        if value is not None:
            self.add_metric([], value)

    def add_metric(self, labels: Sequence[str], value: dict[str, str]) -> None:
        self.samples.append(Sample(self.name + "_info",
                                   dict(dict(zip(self._labelnames, labels)), **value), 1))


class Collector:
    """What a registry collects from: `collect()` yields families, built when asked."""

    def collect(self) -> Iterable[Metric]:
        raise NotImplementedError

    def describe(self) -> Iterable[Metric]:
        return []


class Registry(Collector):
    """Collectors, collected in the order they were registered."""

    def __init__(self) -> None:
        self._collectors: list[Any] = []
        self._lock = threading.Lock()

    def register(self, collector: Any) -> None:
        with self._lock:
            if any(c is collector for c in self._collectors):
                raise ValueError(f"{collector!r} is registered already")
            self._collectors.append(collector)

    def unregister(self, collector: Any) -> None:
        with self._lock:
            self._collectors = [c for c in self._collectors if c is not collector]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            collectors = list(self._collectors)
        for collector in collectors:
            yield from collector.collect()

    def get_sample_value(self, name: str,
                         labels: Optional[dict[str, str]] = None) -> Optional[float]:
        """The value of the sample `name` with exactly `labels`, or None (for tests)."""
        wanted = labels or {}
        for metric in self.collect():
            for sample in metric.samples:
                if sample.name == name and sample.labels == wanted:
                    return sample.value
        return None


class _Instrument:
    """A counter or histogram of the daemon's own: its series by label values, each present
    from the first `labels()` (or from the start, without labels)."""

    typ = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()
        self._series: dict[tuple[str, ...], list[float]] = {}
        if not self.labelnames:
            self._series[()] = self._zero()
        #: Changes so far (a series added, a value moved), and the family collected at that
        #: count: handed out again while nothing changed, so an exposition writer that keeps
        #: what it wrote of a family object (sinks/exposition_text.py) writes it as it was.
        self._changes = 0
        self._collected: Optional[tuple[int, Metric]] = None

    def _zero(self) -> list[float]:
        raise NotImplementedError

    def _values(self, labelvalues: Sequence[object]) -> list[float]:
        if len(labelvalues) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(labelvalues)} label values for "
                             f"{len(self.labelnames)} labels")
        key = tuple(str(v) for v in labelvalues)
        with self._lock:
            values = self._series.get(key)
            if values is None:
                values = self._series[key] = self._zero()
                self._changes += 1
        return values

    def describe(self) -> list[Metric]:
        return [Metric(self.name, self.documentation, self.typ)]

    def collect(self) -> list[Metric]:
        with self._lock:
            changes, kept = self._changes, self._collected
            if kept is not None and kept[0] == changes:
                return [kept[1]]
            series = [(key, list(values)) for key, values in self._series.items()]
        metric = Metric(self.name, self.documentation, self.typ)
        for key, values in series:
            self._add_samples(metric, dict(zip(self.labelnames, key)), values)
        with self._lock:
            self._collected = (changes, metric)
        return [metric]

    def _add_samples(self, metric: Metric, labels: dict[str, str], values: list[float]) -> None:
        raise NotImplementedError


class _CounterSeries:
    __slots__ = ("_counter", "_values")

    def __init__(self, counter: Counter, values: list[float]) -> None:
        self._counter = counter
        self._values = values

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        counter = self._counter
        with counter._lock:
            self._values[0] += amount
            counter._changes += 1


class Counter(_Instrument):
    """A running total: `inc()`, or `labels(*values).inc()` where it has labels."""

    typ = "counter"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        if name.endswith("_total"):
            name = name[:-6]
        super().__init__(name, documentation, labelnames)

    def _zero(self) -> list[float]:
        return [0.0]

    def labels(self, *labelvalues: object) -> _CounterSeries:
        return _CounterSeries(self, self._values(labelvalues))

    def inc(self, amount: float = 1) -> None:
        self.labels().inc(amount)

    def _add_samples(self, metric: Metric, labels: dict[str, str], values: list[float]) -> None:
        metric.add_sample(self.name + "_total", labels, values[0])


class Histogram(_Instrument):
    """Observations counted in buckets (upper bounds, +Inf added), with their sum."""

    typ = "histogram"

    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 labelnames: Sequence[str] = ()) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError("Buckets not in sorted order")
        if not bounds or bounds[-1] != INF:
            bounds.append(INF)
        if len(bounds) < 2:
            raise ValueError("Must have at least two buckets")
        self.bounds = tuple(bounds)
        super().__init__(name, documentation, labelnames)

    def _zero(self) -> list[float]:
        return [0.0] * (len(self.bounds) + 1)  # each bucket's count, then the sum

    def observe(self, amount: float) -> None:
        values = self._values(())
        with self._lock:
            self._changes += 1
            values[-1] += amount
            for i, bound in enumerate(self.bounds):
                if amount <= bound:
                    values[i] += 1
                    break

    def _add_samples(self, metric: Metric, labels: dict[str, str], values: list[float]) -> None:
        count = 0.0
        for bound, n in zip(self.bounds, values):
            count += n
            metric.add_sample(self.name + "_bucket", {**labels, "le": go_string(bound)}, count)
        metric.add_sample(self.name + "_count", labels, count)
        if self.bounds[0] >= 0:
            metric.add_sample(self.name + "_sum", labels, values[-1])
