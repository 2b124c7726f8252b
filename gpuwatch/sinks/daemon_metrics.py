"""The daemon's metrics of itself: its polls, their errors and time, the series the cap dropped,
reloads, reaps, and the trace requests it sent to instrumented processes.

Beside the exporter's ReportCollector, which renders each report, these count what happened
between reports. The names, labels and help texts are part of the interface (docs/metrics.md,
the dashboards and alert rules read them). Every labelled series is present from the start at 0,
so that `increase()` sees its first event. The label values come from the layers that own them
(the reaper's kinds and outcomes, the trace requests' results, the agent socket's statuses):
a sink imports none of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from gpuwatch.metrics import Collector, Counter, Histogram, Metric, Registry
from gpuwatch.model import NodeSnapshot

_POLL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class DaemonMetrics(Collector):
    """The daemon's own counters, one collector registered in `registry`: /metrics lists them in
    the order they are defined here."""

    def __init__(self, registry: Registry, reap_kinds: Iterable[str],
                 reap_outcomes: Iterable[str], trace_request_results: Iterable[str],
                 trace_statuses: Iterable[str], search_results: Iterable[str],
                 series_dropped_reasons: Iterable[str] = (),
                 truncated_texts: Iterable[str] = ()) -> None:
        self.polls = Counter("gpuwatch_polls", "Polls completed.")
        self.poll_errors = Counter(
            "gpuwatch_poll_errors", "Problems met while polling, by source (nvml, procfs, poll: "
            "a poll that raised).", ["source"])
        self.poll_duration = Histogram(
            "gpuwatch_poll_duration_seconds", "Wall time of each poll.", buckets=_POLL_BUCKETS)
        self.series_dropped = Counter(
            "gpuwatch_process_series_dropped",
            "Processes that mattered but got no per-process series because of "
            "exporter.max_process_series, summed over polls, by reason (max_process_series: "
            "the cap left every user short; user_share: the process's user had its share "
            "while others' fit).", ["reason"])
        self.agent_rss_disagreements = Counter(
            "gpuwatch_agent_rss_disagreements",
            "Polls at which an instrumented process's newest report claimed an RSS that the "
            "kernel's figure (/proc) did not bear out; leaks are decided on the kernel's.")
        self.reloads = Counter("gpuwatch_config_reloads", "Configuration reloads by result.",
                               ["result"])
        self.reaped = Counter(
            "gpuwatch_reaped", "Reap actions carried out, by finding kind and result (from the "
            "audit log: `gpuwatch reap` and the daemon's own).", ["kind", "result"])
        self.agent_trace_requests = Counter(
            "gpuwatch_agent_trace_requests", "Requests to instrumented processes to trace their "
            "allocations, by result (sent, failed, rate_limited, disabled).", ["result"])
        self.agent_search_requests = Counter(
            "gpuwatch_agent_search_requests", "Requests to instrumented processes whose leak has "
            "no culprit to search for growing containers faster, by result (sent, failed).",
            ["result"])
        self.agent_trace_reports = Counter(
            "gpuwatch_agent_trace_reports", "Trace reports received from instrumented processes, "
            "by status (done, refused, failed).", ["status"])
        self.text_truncated = Counter(
            "gpuwatch_text_truncated", "Texts another user sets the size of, cut to a bound "
            "(docs/security.md): at the read (command_line, environment, cgroup; once per "
            "process read) or the status document made to fit (document).", ["what"])
        # What the three counters above have been given so far of the running totals they mirror
        # (and text_truncated of its source's).
        self._trace_counted: dict[tuple[str, str], int] = {}
        self._rss_disagreements_counted = 0
        for reason in series_dropped_reasons:
            self.series_dropped.labels(reason)
        for source in ("nvml", "procfs", "poll"):
            self.poll_errors.labels(source)
        for result in ("applied", "refused"):
            self.reloads.labels(result)
        for result in trace_request_results:
            self.agent_trace_requests.labels(result)
        for status in trace_statuses:
            self.agent_trace_reports.labels(status)
        for result in search_results:
            self.agent_search_requests.labels(result)
        for what in truncated_texts:
            self.text_truncated.labels(what)
        # Present from the start at 0, so that `increase()` sees the first reap of each outcome.
        outcomes = tuple(reap_outcomes)
        for kind in sorted(reap_kinds):
            for outcome in outcomes:
                self.reaped.labels(kind, outcome)
        self._metrics = (self.polls, self.poll_errors, self.poll_duration, self.series_dropped,
                         self.agent_rss_disagreements, self.reloads, self.reaped,
                         self.agent_trace_requests, self.agent_search_requests,
                         self.agent_trace_reports, self.text_truncated)
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        for metric in self._metrics:
            yield from metric.describe()

    def collect(self) -> Iterator[Metric]:
        for metric in self._metrics:
            yield from metric.collect()

    def poll_raised(self) -> None:
        """A poll (or what follows it: rendering, trace requests) raised."""
        self.poll_errors.labels("poll").inc()

    def count_poll(self, snapshot: NodeSnapshot, series_dropped: Mapping[str, int],
                   rss_disagreements: int = 0) -> None:
        """A poll completed: its time, the problems its sources met, the series it dropped (by
        reason), and the running total of agents' RSS figures the kernel did not bear out."""
        self.polls.inc()
        self.poll_duration.observe(snapshot.poll_duration_seconds)
        for error in snapshot.errors:
            self.poll_errors.labels(error.source).inc()
        for reason, n in series_dropped.items():
            if n:
                self.series_dropped.labels(reason).inc(n)
        if rss_disagreements > self._rss_disagreements_counted:
            self.agent_rss_disagreements.inc(rss_disagreements - self._rss_disagreements_counted)
            self._rss_disagreements_counted = rss_disagreements

    def count_reload(self, applied: bool) -> None:
        self.reloads.labels("applied" if applied else "refused").inc()

    def count_reaps(self, kind: str, result: str, n: int) -> None:
        self.reaped.labels(kind, result).inc(n)

    def count_traces(self, requests: Mapping[str, int], searches: Mapping[str, int],
                     reports: Mapping[str, int]) -> None:
        """Bring the trace counters up to the running totals of the trace requests (by result)
        and of the agent socket's trace reports (by status)."""
        for counter, key, counts in ((self.agent_trace_requests, "result", requests),
                                     (self.agent_search_requests, "search", searches),
                                     (self.agent_trace_reports, "status", reports)):
            for label, total in counts.items():
                before = self._trace_counted.get((key, label), 0)
                if total > before:
                    counter.labels(label).inc(total - before)
                    self._trace_counted[(key, label)] = total

    def count_truncated(self, counts: Mapping[str, int], running_totals: bool = False) -> None:
        """Count texts cut to a bound, by what: `counts` are new cuts, or with `running_totals`
        the totals of a source's counter (the process source's), brought up to here."""
        for what, n in counts.items():
            if running_totals:
                before = self._trace_counted.get(("truncated", what), 0)
                self._trace_counted[("truncated", what)] = max(before, n)
                n -= before
            if n > 0:
                self.text_truncated.labels(what).inc(n)
