"""The pod source's metrics (gpuwatch.sources.pods): whether the kubelet answers, its calls by
result, and what the bounds of its answers left out."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Callable, Optional, Protocol

from gpuwatch.metrics import Collector, CounterMetricFamily, GaugeMetricFamily, Metric

#: What the decoder's bounds leave out of a kubelet's answer.
CUT_WHATS = ("pods", "containers", "devices", "names")


class PodSourceState(Protocol):
    @property
    def kubelet_error(self) -> Optional[str]: ...

    @property
    def calls_answered(self) -> int: ...

    @property
    def calls_failed(self) -> int: ...

    @property
    def cut(self) -> Mapping[str, int]: ...


class PodSourceCollector(Collector):
    """Reads the pod source's state at each scrape (`state`: its `status`)."""

    def __init__(self, state: Callable[[], PodSourceState]) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        s = self.state()
        asked = s.calls_answered + s.calls_failed
        up = GaugeMetricFamily(
            "gpuwatch_kubelet_up", "1 when the kubelet's PodResources service answered the "
            "last call, 0 when it did not; absent while it was never asked (no socket).")
        if asked:
            up.add_metric([], 0.0 if s.kubelet_error else 1.0)
        yield up
        calls = CounterMetricFamily(
            "gpuwatch_kubelet_calls", "Calls to the kubelet's PodResources service (off the "
            "poll loop), by result: answered, or failed (timeout, refused, not the protocol).",
            labels=["result"])
        calls.add_metric(["answered"], float(s.calls_answered))
        calls.add_metric(["failed"], float(s.calls_failed))
        yield calls
        cut = CounterMetricFamily(
            "gpuwatch_kubelet_answer_cut", "Entries of the kubelet's answers left out by their "
            "bounds (docs/security.md), by what: pods, containers, devices, names.",
            labels=["what"])
        for what in CUT_WHATS:
            cut.add_metric([what], float(s.cut.get(what, 0)))
        yield cut
