"""Prometheus exporter: a custom collector that renders the latest snapshot on every scrape.

Metrics are built from the latest snapshot each time, so a process that exited leaves no stale
series behind, and a scrape never polls: it only reads what the daemon's last poll produced. A
section whose inputs are equal to its last build's hands in the families built then
(sinks/built_families.py).
docs/metrics.md lists every metric; names and labels are an interface for dashboards and alerts.

What a scraper learns is identity, as `ps` shows it on a node without hidepid: PIDs, `comm`,
users, the job (the one value read from a process's environment), figures (memory, steps, sizes)
and the names a program gives what it watches. Never private text: no command line, no other
environment value, no finding's reason (words that quote command lines and launch variables),
no source path (a traced culprit's `file:line`). Those stay on the state socket, which only the
daemon's group reads (docs/security.md, rule 5). A finding's evidence is served as its summary
(`gpuwatch_finding_info`): the detectors build it from identity and figures only.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Callable, Optional

from gpuwatch import __version__
from gpuwatch.agent_budget import (
    BUDGET_REASONS,
    EVICTED_WHAT,
    PARTS,
    REFUSED_WHAT,
    BudgetStats,
)
from gpuwatch.evidence import CopyOnWrite, Culprit, LeakEvidence
from gpuwatch.metrics import Collector, CounterMetricFamily, InfoMetricFamily, Metric
from gpuwatch.model import (
    KINDS,
    Finding,
    GpuDevice,
    HostProcess,
    Kind,
    NodeReport,
    NodeSnapshot,
)
from gpuwatch.sinks.built_families import BuiltFamilies
from gpuwatch.sinks.exported_processes import agent_series_cap, exported_processes
from gpuwatch.sinks.exposition_text import Family, Row
from gpuwatch.sinks.process_rows import (
    BUFFER_LABELS,
    GPU_PROCESS_LABELS,
    PROCESS_FAMILIES,
    PROCESS_LABELS,
    ProcessFamilies,
    process_labels,
    process_rows,
)
from gpuwatch.vocabulary import FoundBy, Series

log = logging.getLogger(__name__)

#: The sections of /metrics that ReportCollector renders apart (gpuwatch_exporter_section_success).
EXPORTER_SECTIONS = ("build", "agent_reports", "agent_memory", "node", "gpus", "processes",
                     "findings", "leaks")


#: platform.python_version() without the platform module (kept for the daemon's life).
_PYTHON_VERSION = sys.version.split()[0]


_GPU_LABELS = ("gpu", "uuid", "name")
#: The gauges a GPU has, by name: their help, and the GPU's figure (None: no sample).
_GPU_GAUGES: tuple[tuple[str, str, Callable[[GpuDevice], Optional[float]]], ...] = (
    ("gpuwatch_gpu_read_ok", "1 when every NVML call for the GPU succeeded in the last poll.",
     lambda g: 0.0 if g.errors else 1.0),
    ("gpuwatch_gpu_memory_total_bytes", "Total memory of the GPU.",
     lambda g: g.memory_total_bytes),
    ("gpuwatch_gpu_memory_used_bytes",
     "GPU memory in use (driver reservations excluded where NVML separates them).",
     lambda g: g.memory_used_bytes),
    ("gpuwatch_gpu_memory_reserved_bytes", "GPU memory reserved by the driver.",
     lambda g: g.memory_reserved_bytes),
    ("gpuwatch_gpu_unattributed_memory_bytes",
     "Used GPU memory that no process listed by NVML accounts for.",
     lambda g: g.unattributed_memory_bytes),
    ("gpuwatch_gpu_utilization_ratio",
     "Share of the last sample period in which a kernel ran on the GPU (0-1).",
     lambda g: None if g.utilization_gpu_percent is None else g.utilization_gpu_percent / 100.0),
)


#: The longest culprit label value. A culprit is a watched buffer's name or a discovered
#: container's qualified name; cutting from the front keeps the innermost names, which tell it
#: apart.
CULPRIT_LABEL_MAX = 128


def culprit_label(culprit: Optional[Culprit]) -> str:
    """The `culprit` label value: empty when none, or when it was traced (a `file:line`: a path
    in the program's sources), else at most CULPRIT_LABEL_MAX characters."""
    text = culprit.name if culprit is not None and culprit.found_by != FoundBy.TRACED else ""
    if len(text) <= CULPRIT_LABEL_MAX:
        return text
    return "..." + text[-(CULPRIT_LABEL_MAX - 3):]


#: The longest `summary` label value: the evidence in a sentence, its start the most telling.
SUMMARY_LABEL_MAX = 200


def summary_label(summary: str) -> str:
    """The `summary` label value: at most SUMMARY_LABEL_MAX characters, cut at the end."""
    if len(summary) <= SUMMARY_LABEL_MAX:
        return summary
    return summary[:SUMMARY_LABEL_MAX - 3] + "..."


class ReportCollector(Collector):
    def __init__(self, latest: Callable[[], Optional[NodeReport]],
                 max_process_series: int = 1000,
                 agent_counts: Optional[Callable[[], tuple[int, Mapping[str, int]]]] = None,
                 agent_budget: Optional[Callable[[], BudgetStats]] = None,
                 max_agent_series: int = 2000) -> None:
        self._latest = latest
        self.max_process_series = max_process_series
        self._agent_counts = agent_counts
        self._agent_budget = agent_budget
        #: agent.max_series_per_user.
        self.max_agent_series = max_agent_series
        self._agent_series_dropped = 0
        #: (report, cap, exported_processes of it): the poll's counts and every scrape of one
        #: report share one selection. Replaced whole, so a scrape's thread reads it safely.
        self._exported: Optional[tuple[NodeReport, int,
                                       tuple[list[HostProcess], dict[str, int]]]] = None
        #: Sections whose last render failed: logged once until they render again.
        self._failing: set[str] = set()
        #: Each exported process's rows at the last render, by PID: made again only when what
        #: they are made of changed (most processes' between two polls do not). Replaced whole.
        self._process_rows: dict[int, tuple[tuple[object, ...], ProcessFamilies]] = {}
        #: The sections whose inputs are few, built again only when those change.
        self._built = BuiltFamilies()

    def exported(self, report: NodeReport) -> tuple[list[HostProcess], dict[str, int]]:
        """exported_processes of `report` under max_process_series, worked out once a report."""
        memo = self._exported
        if memo is not None and memo[0] is report and memo[1] == self.max_process_series:
            return memo[2]
        result = exported_processes(report, self.max_process_series)
        self._exported = (report, self.max_process_series, result)
        return result

    def count_poll(self, report: NodeReport) -> int:
        """Count the agent series the per-user cap leaves out of this poll's report (summed
        over polls, as gpuwatch_agent_series_dropped_total); the number."""
        exported, _ = self.exported(report)
        _, dropped = agent_series_cap(report, exported, self.max_agent_series)
        self._agent_series_dropped += dropped
        return dropped

    def describe(self) -> Iterable[Metric]:
        # Registering must not call collect(): there may be no snapshot yet.
        return []

    def collect(self) -> Iterator[Metric]:
        """The families of the latest report, section by section (EXPORTER_SECTIONS): each is
        built whole before any of it is yielded, so a bad value (a figure that is not a number,
        a report the exporter does not expect) costs its section, logged and counted in
        gpuwatch_exporter_section_success, never the scrape."""
        report = self._latest()
        succeeded: list[tuple[str, bool]] = []
        for section, build in self._sections(report):
            try:
                built = list(build())
            except Exception as e:
                succeeded.append((section, False))
                if section not in self._failing:
                    self._failing.add(section)
                    log.warning("/metrics: the %s section is left out of the scrape, a value "
                                "in it could not be rendered: %s: %s", section,
                                type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
                continue
            if section in self._failing:
                self._failing.discard(section)
                log.warning("/metrics: the %s section renders again", section)
            succeeded.append((section, True))
            yield from built
        yield _gauge("gpuwatch_exporter_section_success",
                     "1 when the section of /metrics rendered in this body, 0 when a value in "
                     "it could not be (the daemon's log says which): one bad value costs its "
                     "section, never the scrape.", ["section"],
                     [([section], 1.0 if ok else 0.0) for section, ok in succeeded])

    def _sections(self, report: Optional[NodeReport]
                  ) -> Iterator[tuple[str, Callable[[], Iterable[Metric]]]]:
        built = self._built
        yield "build", lambda: built.get("build", (), self._build)
        if self._agent_counts is not None:
            counts = self._agent_counts
            yield "agent_reports", lambda: self._agent_reports(*counts())
        if self._agent_budget is not None:
            budget = self._agent_budget
            yield "agent_memory", lambda: self._agent_memory_kept(budget())
        if report is None:
            return
        s = report.snapshot
        yield "node", lambda: self._node(s)
        yield "gpus", lambda: built.get("gpus", s.gpus, lambda: self._gpus(s))
        yield "processes", lambda: self._processes(report, self.exported(report)[0])
        yield "findings", lambda: self._findings_kept(report)
        yield "leaks", lambda: self._leaks_kept(report)

    def _findings_kept(self, report: NodeReport) -> list[Metric]:
        shown = _findings_with_series(report, self.exported(report)[0])
        return self._built.get("findings", (shown, report.findings),
                               lambda: self._findings(shown, report.findings))

    def _leaks_kept(self, report: NodeReport) -> list[Metric]:
        shown = _findings_with_series(report, self.exported(report)[0])
        s = report.snapshot
        # A leak's projected OOM is a time from the poll's: the only input that moves alone.
        now = s.wall(s.taken_at) if any(f.kind == Kind.LEAK for f in shown) else None
        return self._built.get("leaks", (shown, now), lambda: self._leaks(report, shown))

    def _build(self) -> Iterator[Metric]:
        build = InfoMetricFamily("gpuwatch_build", "Version of the running gpuwatch, and the "
                                 "PID of the daemon serving it (as daemon.json names it).")
        # `pid` tells whose /metrics a port serves: `gpuwatch doctor` matches it against the
        # daemon.json of the runtime directory it checks.
        build.add_metric([], {"version": __version__, "python": _PYTHON_VERSION,
                              "pid": str(os.getpid())})
        yield build

    def _node(self, s: NodeSnapshot) -> Iterator[Metric]:
        yield from self._built.get("node_info", (s.hostname, s.nvml), lambda: self._node_info(s))
        yield _gauge("gpuwatch_last_poll_timestamp_seconds",
                     "When the snapshot being served was taken (seconds since the epoch).",
                     [], [([], s.wall(s.taken_at))])
        yield _gauge("gpuwatch_clock_step_seconds",
                     "How far the wall clock has stepped since the daemon started (an NTP step, "
                     "a VM resumed): durations are timed on a clock that does not step, and "
                     "times shown are corrected by this.", [], [([], round(s.clock_step, 3))])
        yield _gauge("gpuwatch_last_poll_duration_seconds",
                     "Wall time of the poll that produced the snapshot being served.",
                     [], [([], s.poll_duration_seconds)])

    def _node_info(self, s: NodeSnapshot) -> Iterator[Metric]:
        node = InfoMetricFamily(
            "gpuwatch_node", "The node as its daemon names it (daemon.node_name, else the "
            "hostname), with its driver and gpuwatch versions: join on instance for a node name "
            "that survives pod IPs and DNS aliases.")
        node.add_metric([], {"node": s.hostname, "version": __version__,
                             "driver_version": s.nvml.driver_version or "",
                             "cuda_driver_version": s.nvml.cuda_driver_version or ""})
        yield node
        yield _gauge("gpuwatch_nvml_up",
                     "1 when NVML answered the last poll, 0 when it is unavailable.",
                     [], [([], 1.0 if s.nvml.available else 0.0)])
        if s.nvml.device_files is not None:
            yield _gauge("gpuwatch_nvidia_device_files",
                         "While NVML is unavailable: the node's /dev/nvidiaN device files (more "
                         "than 0: a GPU node whose driver does not answer).",
                         [], [([], float(s.nvml.device_files))])
        if s.nvml.available:
            info = InfoMetricFamily("gpuwatch_nvml", "NVML and driver versions.")
            info.add_metric([], {"driver_version": s.nvml.driver_version or "",
                                 "nvml_version": s.nvml.nvml_version or "",
                                 "cuda_driver_version": s.nvml.cuda_driver_version or ""})
            yield info

    def _gpus(self, s: NodeSnapshot) -> Iterator[Metric]:
        keyed = [([str(g.index), g.uuid or "", g.name or ""], g) for g in s.gpus]
        for name, doc, figure in _GPU_GAUGES:
            yield _gauge(name, doc, _GPU_LABELS,
                         [(key, float(value)) for key, g in keyed
                          if (value := figure(g)) is not None])

    def _processes(self, report: NodeReport, exported: list[HostProcess]) -> list[Metric]:
        snapshot = report.snapshot
        agents, wall = snapshot.agents, snapshot.wall
        allowed, _ = agent_series_cap(report, exported, self.max_agent_series)
        flagged = {f.pid for f in report.findings if f.pid is not None}
        kept = self._process_rows
        made: dict[int, tuple[tuple[object, ...], ProcessFamilies]] = {}
        for p in exported:
            agent = agents.get(p.pid)
            fit = allowed.get(p.pid, 0)
            if fit < 0:  # over its user's cap: only what it has as a GPU holder or finding
                agent = None
                if not (p.holds_gpu or p.pid in flagged):
                    continue
            job = report.job_of(p)
            # To the kernel's tick, the figure's resolution: the wall clock's correction
            # moves by microseconds from poll to poll, and the series stays put.
            started = round(wall(p.start_time), 2) if p.start_time is not None else None
            stepped = (wall(agent.step_changed_at) if agent is not None and agent.step is not None
                       and agent.step_changed_at is not None else None)
            # Everything the rows are made of (as DocumentWriter keys a process's JSON).
            key = (p, job, agent, fit, started, stepped)
            entry = kept.get(p.pid)
            if entry is None or entry[0] != key:
                entry = (key, process_rows(p, job, agent, fit, started, stepped))
            made[p.pid] = entry
        self._process_rows = made
        # The families of the last render where every process's rows are those kept then
        # (compared by identity first: most are the very entries of _process_rows).
        return self._built.get("processes", (len(agents), list(made.values())),
                               lambda: self._process_families_of(made, len(agents)))

    @staticmethod
    def _process_families_of(made: dict[int, tuple[tuple[object, ...], ProcessFamilies]],
                             agents: int) -> Iterator[Metric]:
        yield _gauge("gpuwatch_agent_processes", "Processes with an agent slot at the last "
                     "poll (at most agent.max_processes).", [], [([], float(agents))])
        gpu_mem, rss, start, steps, step_at, items, sizes = (
            [r for _, families in made.values() for r in families[i]]
            for i in range(PROCESS_FAMILIES))
        yield _family("gpuwatch_process_gpu_memory_bytes",
                      "GPU memory a process holds on one GPU, as NVML reports it.",
                      GPU_PROCESS_LABELS, gpu_mem)
        yield _family("gpuwatch_process_resident_memory_bytes",
                      "Resident host memory (RSS) of a process that matters.", PROCESS_LABELS, rss)
        yield _family("gpuwatch_process_start_time_seconds",
                      "Start time of a process that matters; with pid it identifies the process.",
                      PROCESS_LABELS, start)
        yield _family("gpuwatch_agent_step", "Newest training step an instrumented process "
                      "reported.", PROCESS_LABELS, steps)
        yield _family("gpuwatch_agent_step_timestamp_seconds",
                      "When an instrumented process's step last advanced.", PROCESS_LABELS,
                      step_at)
        yield _family("gpuwatch_agent_buffer_items", "Items in a buffer an instrumented process "
                      "watches (agent.watch).", BUFFER_LABELS, items)
        yield _family("gpuwatch_agent_buffer_bytes", "Bytes in a buffer an instrumented process "
                      "watches, where the agent can size them.", BUFFER_LABELS, sizes)

    def _agent_reports(self, accepted: int, rejected: Mapping[str, int]) -> list[Metric]:
        return self._built.get("agent_reports",
                               (accepted, dict(rejected), self._agent_series_dropped),
                               lambda: self._agent_totals(accepted, rejected))

    def _agent_memory_kept(self, stats: BudgetStats) -> list[Metric]:
        return self._built.get("agent_memory", (stats.max_bytes, dict(stats.by_part), stats.users,
                                                dict(stats.refused), dict(stats.evicted)),
                               lambda: self._agent_memory(stats))

    def _agent_totals(self, accepted: int, rejected: Mapping[str, int]) -> Iterator[Metric]:
        ok = CounterMetricFamily("gpuwatch_agent_reports", "Agent reports accepted.")
        ok.add_metric([], float(accepted))
        yield ok
        bad = CounterMetricFamily("gpuwatch_agent_reports_rejected",
                                  "Agent reports rejected, by reason (docs/agent-protocol.md).",
                                  labels=["reason"])
        for reason, n in sorted(rejected.items()):
            bad.add_metric([reason], float(n))
        yield bad
        dropped = CounterMetricFamily(
            "gpuwatch_agent_series_dropped", "Series of instrumented processes left out of "
            "/metrics by agent.max_series_per_user, summed over polls.")
        dropped.add_metric([], float(self._agent_series_dropped))
        yield dropped

    def _agent_memory(self, stats: BudgetStats) -> Iterator[Metric]:
        yield _gauge("gpuwatch_agent_memory_bytes",
                     "Memory that agent reports make the daemon keep, by part (receiver, "
                     "pending, history), as charged to agent.memory_budget.", ["part"],
                     [([part], float(stats.by_part.get(part, 0))) for part in PARTS])
        yield _gauge("gpuwatch_agent_memory_budget_bytes",
                     "agent.memory_budget: what agent state may hold before users above their "
                     "share are refused and give back.", [], [([], float(stats.max_bytes))])
        yield _gauge("gpuwatch_agent_users",
                     "Users holding agent state, who share the budget and the slots.", [],
                     [([], float(stats.users))])
        yield _by_what_and_reason(
            "gpuwatch_agent_history_refused", "Step histories (history) and buffer or "
            "discovered series (series) the budget refused to keep, by reason (user_share, "
            "memory_budget).", REFUSED_WHAT, stats.refused)
        yield _by_what_and_reason(
            "gpuwatch_agent_evicted", "What the budget took back from users above their "
            "share: a reporting process's slot (process) or its step history (history), by "
            "reason (user_share, memory_budget).", EVICTED_WHAT, stats.evicted)

    def _leaks(self, report: NodeReport, findings: tuple[Finding, ...]) -> Iterator[Metric]:
        """One series per leaking process and metric: a leak finding is one per process, and
        its culprit and how it was found are labels of that one series, not series of their
        own."""
        labels = [*PROCESS_LABELS, "series", "culprit", "found_by"]
        per_step, oom_step, per_second, oom_at = [], [], [], []
        culprit_bytes, culprit_items = [], []
        for f in findings:
            if f.kind != Kind.LEAK:
                continue
            e = f.details
            if isinstance(e, CopyOnWrite):
                key = [*process_labels(f.pid, f.name, f.user, f.job), Series.USS.value, "", ""]
                per_second.append((key, float(e.growth_bytes_per_second)))
                continue
            if not isinstance(e, LeakEvidence):
                continue
            c = e.culprit
            key = [*process_labels(f.pid, f.name, f.user, f.job), e.series_text,
                   culprit_label(c),
                   str(c.found_by or "") if c is not None else ""]
            if e.growth_bytes_per_step is not None:
                per_step.append((key, float(e.growth_bytes_per_step)))
            if e.growth_bytes_per_second is not None:
                per_second.append((key, float(e.growth_bytes_per_second)))
            oom = e.projection
            if oom is not None and oom.step is not None:
                oom_step.append((key, float(oom.step)))
            if oom is not None and oom.in_seconds is not None:
                oom_at.append((key, report.snapshot.wall(report.snapshot.taken_at)
                               + oom.in_seconds))
            if c is not None and c.name and c.bytes_per_step is not None:
                culprit_bytes.append((key, float(c.bytes_per_step)))
            # An autograd history's items are its graph nodes (as the agent reports them): the
            # one series of a leak of `autograd history`, which has no bytes.
            items = (None if c is None or not c.name
                     else c.graph_nodes_per_step if c.found_by == FoundBy.AUTOGRAD
                     else c.items_per_step)
            if items is not None:
                culprit_items.append((key, float(items)))
        yield _gauge("gpuwatch_leak_growth_bytes_per_step",
                     "Growth per training step of a leaking figure (RSS, GPU memory, a buffer).",
                     labels, per_step)
        yield _gauge("gpuwatch_leak_projected_oom_step",
                     "Training step at which a leak runs out of memory against the tightest "
                     "limit.", labels, oom_step)
        yield _gauge("gpuwatch_leak_growth_bytes_per_second",
                     "Growth per second of a leaking figure in a process without the agent.",
                     labels, per_second)
        yield _gauge("gpuwatch_leak_projected_oom_timestamp_seconds",
                     "When a leak is projected to run out of memory (seconds since the epoch).",
                     labels, oom_at)
        yield _gauge("gpuwatch_leak_culprit_bytes_per_step",
                     "Growth per training step of what explains a leak (a watched buffer, a "
                     "discovered container, a traced allocation site), where its bytes are "
                     "known.", labels, culprit_bytes)
        yield _gauge("gpuwatch_leak_culprit_items_per_step",
                     "Items added per training step to the container that explains a leak, "
                     "where it is counted.", labels, culprit_items)

    def _findings(self, findings: tuple[Finding, ...], every: tuple[Finding, ...]
                  ) -> Iterator[Metric]:
        """The findings, by what identifies them (kind, process, job, GPU) and their severity:
        a series for each of `findings`, the count by kind of `every`.

        A finding's reason is not served: it is words that quote what the process chose (its
        command line, launch variables), and /metrics shows identity only. `gpuwatch status`
        (the state socket) has it. Its summary, the same evidence from identity and figures, is
        on `gpuwatch_finding_info` alone: words are for tables and alert annotations, never for
        the labels of the series alerts are built on (docs/design-notes.md)."""
        labels = ["kind", "severity", *PROCESS_LABELS, "gpu"]
        open_, memory, info = [], [], []
        counts = dict.fromkeys(KINDS, 0)
        for f in every:
            counts[f.kind] = counts.get(f.kind, 0) + 1
        for f in findings:
            key = [f.kind, f.severity, *process_labels(f.pid, f.name, f.user, f.job),
                   ",".join(map(str, f.gpus))]
            open_.append((key, 1.0))
            info.append(([*key, summary_label(f.summary)], 1.0))
            if f.gpu_memory_bytes is not None:
                memory.append((key, float(f.gpu_memory_bytes)))
        yield _gauge("gpuwatch_finding",
                     "1 for each open finding; the labels say what and where (its evidence: "
                     "gpuwatch status on the node).", labels, open_)
        yield _gauge("gpuwatch_finding_info",
                     "1 for each open finding, with its evidence summed up from identity and "
                     "figures (no command line, environment value or path): for tables and alert "
                     "annotations, never for an alert's labels.", [*labels, "summary"], info)
        yield _gauge("gpuwatch_findings", "Open findings by kind.", ["kind"],
                     [([kind], float(n)) for kind, n in counts.items()])
        yield _gauge("gpuwatch_finding_gpu_memory_bytes",
                     "GPU memory at stake in an open finding (what reaping it would free).",
                     labels, memory)


def _findings_with_series(report: NodeReport, exported: list[HostProcess]
                          ) -> tuple[Finding, ...]:
    """The findings that get series of their own: those of the processes exported_processes
    keeps, and those of no process (a ghost). Under exporter.max_process_series one user's
    thousands of findings (fake leaks it raises against itself) take no other user's series and
    do not grow the scrape past the cap; gpuwatch_findings still counts them all, and the
    processes left out are counted in gpuwatch_process_series_dropped_total."""
    kept = {p.pid for p in exported}
    return tuple(f for f in report.findings if f.pid is None or f.pid in kept)


def _by_what_and_reason(name: str, documentation: str, whats: Iterable[str],
                        counts: Mapping[tuple[str, str], int]) -> CounterMetricFamily:
    """A counter with every (what, reason) pair present from the start, 0 where none was."""
    family = CounterMetricFamily(name, documentation, labels=["what", "reason"])
    for what in whats:
        for reason in BUDGET_REASONS:
            family.add_metric([what, reason], float(counts.get((what, reason), 0)))
    return family


def _gauge(name: str, doc: str, labels: list[str] | tuple[str, ...],
           samples: Iterable[tuple[list[str], float]]) -> Family:
    """A gauge family, written line by line by exposition_text.LineWriter."""
    family = Family(name, doc, labels)
    for values, value in samples:
        family.add(values, value)
    return family


def _family(name: str, doc: str, labels: tuple[str, ...], rows: list[Row]) -> Family:
    """A gauge family of rows made by exposition_text.row."""
    family = Family(name, doc, labels)
    family.extend(rows)
    return family
