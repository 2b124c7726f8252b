"""The Prometheus alert rules, as data: `python dashboards/build.py` writes gpuwatch-alerts.yml.

Shape, as in the monitoring mixins: a state test on what the daemon found, a `for:` that outlasts
a blip, a `severity` label, a summary, a description and a `runbook_url`.

An alert's labels are what identifies it and nothing else: the scrape job and instance, the
node's name (joined from `gpuwatch_node_info`), and for the alerts about processes the training
job (`job_id`, `job_source`). A job's eight orphaned workers raise one alert, not eight; a
reason that changes, a process that is reaped while others remain, a severity or a GPU list that
moves do not resolve it and raise it anew. The per-process detail (PIDs, names, users, GPUs and
each finding's summary) is fetched into the description with `query`, from
`gpuwatch_finding_info`. /metrics carries the summary, never a finding's full reason (it quotes
what a process chose: docs/security.md, rule 5); each description says where that is:
`gpuwatch status` on the node.

Severity: `critical` where GPU memory is at stake (the next job on the node fails) or a job runs
out of memory within the hour; `warning` for what needs a look today; `info` for hygiene.

Standard library only; the settings (scrape selector, runbook address, `for:` scaling for
tests) are `Settings`, given on build.py's command line.
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import dataclass
from typing import Any, Optional

DEFAULT_SELECTOR = 'job="gpuwatch"'
DEFAULT_RUNBOOK_URL = "https://github.com/gpuwatch/gpuwatch/blob/main/docs/runbooks.md"

#: What an alert about a job's processes is identified by.
JOB_KEYS = "instance, job, job_id, job_source, pod_namespace, pod_name"
NODE_KEYS = "instance, job"
GHOST = 'kind="ghost"'
#: Where a finding's full evidence is: /metrics carries only its summary.
EVIDENCE = " Full evidence: `gpuwatch status` on the node."
#: A listed finding's summary, after its identity (none from a daemon that serves none).
SUMMARY = "{{ with .Labels.summary }}: {{ . }}{{ end }}."


#: A leak's culprit in words, as the finding's reason puts it, from the labels of a leak series
#: (`.`): how it was found decides the wording. A series without `found_by` (an older daemon)
#: reads as a watched buffer, the only culprit such a daemon names. A traced culprit is a source
#: file and line, which /metrics does not carry. An autograd culprit is a tensor keeping every
#: step's graph (a loss summed without `.item()`).
_CULPRIT = (
    "{{ if eq .Labels.found_by \"traced\" }}, an allocation site explains it (traced: "
    "`gpuwatch status` on the node names it)"
    "{{ else if eq .Labels.found_by \"discovered\" }}, `{{ .Labels.culprit }}` explains it "
    "(discovered)"
    "{{ else if eq .Labels.found_by \"autograd\" }}, `{{ .Labels.culprit }}` holds the graph of "
    "every step: use `loss.item()` or `.detach()` (autograd)"
    "{{ else if .Labels.culprit }}, buffer `{{ .Labels.culprit }}` explains it"
    "{{ with .Labels.found_by }} ({{ . }}){{ end }}{{ end }}")


def _count(one: str, many: str) -> str:
    """The alert's value with its noun, as a template: '1 process', '3 processes'."""
    return "{{ $value }} " + _agreeing(one, many)


def _agreeing(one: str, many: str) -> str:
    """`one` where the alert's value is 1, else `many`: a verb or pronoun that agrees with the
    count ('holds'/'hold', 'its'/'their')."""
    return "{{ if eq $value 1.0 }}" + one + "{{ else }}" + many + "{{ end }}"


@dataclass(frozen=True)
class Settings:
    #: Selects gpuwatch's series and its scrape targets' `up` (monitoring-mixin style).
    selector: str = DEFAULT_SELECTOR
    #: Where docs/runbooks.md is read; each alert links to its section.
    runbook_url: str = DEFAULT_RUNBOOK_URL
    #: Multiplies every `for:` (end-to-end tests use a small factor); at least 1 s when scaled.
    for_scale: float = 1.0


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str


def _seconds(duration: str) -> int:
    number, unit = int(duration[:-1]), duration[-1]
    return number * {"s": 1, "m": 60, "h": 3600}[unit]


def _duration(seconds: float) -> str:
    seconds = max(1, round(seconds))
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


class Rules:
    """The alert rules for one set of Settings."""

    def __init__(self, settings: Settings = Settings()) -> None:
        self.s = settings

    # -- expression pieces ---------------------------------------------------------------------
    def per_job(self, matchers: str) -> str:
        """How many processes of each training job on a node have findings `matchers`; for a
        Kubernetes pod's, the alert's `namespace` is the pod's, which Alertmanager routes by
        (a series's own `namespace`, where the scrape gives one, is gpuwatch's)."""
        return self.pod_namespace(self.with_node(
            f"count by ({JOB_KEYS}) ({self.m('gpuwatch_finding', matchers)})"))

    @staticmethod
    def pod_namespace(expr: str) -> str:
        """`expr`, with `namespace` set from `pod_namespace` where that is not empty."""
        return ("label_replace(\n" + expr
                + ',\n"namespace", "$1", "pod_namespace", "(.+)"\n)')

    def m(self, name: str, matchers: str = "") -> str:
        """A gpuwatch series, narrowed by the selector (and `matchers`)."""
        inner = ", ".join(part for part in (self.s.selector, matchers) if part)
        return f"{name}{{{inner}}}"

    def with_node(self, expr: str) -> str:
        """`expr`, with the node's name as a label (the hostname the daemon reports, which
        outlives pod IPs and DNS aliases in `instance`)."""
        return (f"(\n  {expr}\n)\n* on ({NODE_KEYS}) group_left (node)\n"
                f"  max by ({NODE_KEYS}, node) ({self.m('gpuwatch_node_info')})")

    @staticmethod
    def listing(metric_matchers: str, item: str) -> str:
        """A template that lists the series of `gpuwatch_finding_info{metric_matchers}` for the
        alert's job on its node, one `item` each, sorted by PID."""
        query = ('gpuwatch_finding_info{job=%q, instance=%q, job_id=%q, '
                 + metric_matchers + '}')
        return ("{{ range printf `" + query + "` $labels.job $labels.instance $labels.job_id"
                " | query | sortByLabel \"pid\" }} " + item + "{{ end }}")

    @staticmethod
    def memory(matchers: str, keys: str = "job_id=%q", args: str = " $labels.job_id") -> str:
        """A template for the GPU memory the findings behind the alert hold, in total."""
        query = ("sum(gpuwatch_finding_gpu_memory_bytes{job=%q, instance=%q, " + keys + ", "
                 + matchers + "})")
        return ("{{ with printf `" + query + "` $labels.job $labels.instance" + args
                + " | query }}{{ . | first | value | humanize1024 }}B"
                "{{ else }}an unknown amount{{ end }}")

    # -- the rules -----------------------------------------------------------------------------
    def finding_alerts(self) -> list[Alert]:
        job = ("{{ with $labels.pod_name }}pod {{ $labels.pod_namespace }}/{{ . }}{{ else }}"
               "{{ with $labels.job_id }}job {{ $labels.job_source }}:{{ . }}"
               "{{ else }}no known job{{ end }}{{ end }}")
        node = "{{ $labels.node }}"
        process = "{{ .Labels.pid }} ({{ .Labels.name }}, user {{ .Labels.user }}"
        return [
            Alert("GpuwatchOrphansHoldGpuMemory",
                  self.per_job('kind="orphan", gpu!=""'),
                  "5m", "critical",
                  f"Orphaned processes of {job} hold GPU memory on {node}.",
                  f"{_count('process', 'processes')} of {job} on {node} "
                  + _agreeing("holds", "hold") + " " + self.memory('kind="orphan"')
                  + " of GPU memory although " + _agreeing("its", "their") + " launcher has "
                  "exited; the next job on these GPUs will run out of memory."
                  + self.listing('kind="orphan", gpu!=""',
                                 "PID " + process + ", GPU {{ .Labels.gpu }})" + SUMMARY)
                  + " On the node: `gpuwatch status` for the full evidence, `gpuwatch reap "
                  "--dry-run "
                  "--job {{ $labels.job_id }}` for the plan."),
            Alert("GpuwatchLeftoversHoldGpuMemory",
                  self.per_job('kind="leftover", gpu!=""'),
                  "5m", "critical",
                  f"Processes of finished {job} hold GPU memory on {node}.",
                  f"{_count('process', 'processes')} of {job} on {node} "
                  + _agreeing("holds", "hold") + " " + self.memory('kind="leftover"')
                  + " of GPU memory after the job's trainer finished."
                  + self.listing('kind="leftover", gpu!=""',
                                 "PID " + process + ", GPU {{ .Labels.gpu }})" + SUMMARY)
                  + " On the node: `gpuwatch status` for the full evidence, `gpuwatch reap "
                  "--dry-run "
                  "--job {{ $labels.job_id }}` for the plan."),
            Alert("GpuwatchLeftoverProcesses",
                  self.per_job('kind="leftover", gpu=""'),
                  "1h", "info",
                  f"Processes of finished {job} are still running on {node}.",
                  f"{_count('helper process', 'helper processes')} of {job} on {node} "
                  + _agreeing("has", "have") + " outlived the job's trainer for over an hour, "
                  "holding host memory and ports."
                  + self.listing('kind="leftover", gpu=""', "PID " + process + ")" + SUMMARY)
                  + EVIDENCE),
            Alert("GpuwatchZombiesHoldGpuMemory",
                  self.per_job('kind="zombie", severity="critical"'),
                  "2m", "critical",
                  f"Defunct processes of {job} keep GPU memory on {node}.",
                  f"{_count('process', 'processes')} of {job} on {node} "
                  + _agreeing("is", "are") + " defunct but " + _agreeing("its", "their")
                  + " threads (an NCCL heartbeat, a thread pool) still run and hold "
                  + self.memory('kind="zombie", severity="critical"')
                  + " of GPU memory; only killing " + _agreeing("it", "them") + " frees it."
                  + self.listing('kind="zombie", severity="critical"',
                                 "PID " + process + ", GPU {{ .Labels.gpu }})" + SUMMARY)
                  + EVIDENCE),
            Alert("GpuwatchGhostGpuMemory",
                  self.with_node(f"sum by ({NODE_KEYS}) "
                                 f"({self.m('gpuwatch_finding_gpu_memory_bytes', GHOST)}) > 0"),
                  "10m", "warning",
                  f"GPU memory on {node} is held by no live process.",
                  "{{ $value | humanize1024 }}B of GPU memory on " + node + " is held by no "
                  "process gpuwatch can see:"
                  "{{ range printf `gpuwatch_finding_gpu_memory_bytes{job=%q, instance=%q, "
                  "kind=\"ghost\"}` $labels.job $labels.instance | query | sortByLabel \"gpu\" }}"
                  " GPU {{ .Labels.gpu }}: {{ .Value | humanize1024 }}B"
                  "{{ with .Labels.pid }} (NVML lists PID {{ . }}, which /proc does not have)"
                  "{{ end }}."
                  "{{ end }}" + EVIDENCE),
            Alert("GpuwatchMemoryLeakOutOfMemorySoon",
                  self._leak_expr(6 * 3600), "5m", "warning",
                  f"A process of {job} on {node} leaks memory and runs out within 6 hours.",
                  self._leak_description(job, node)),
            Alert("GpuwatchMemoryLeakOutOfMemoryImminent",
                  self._leak_expr(3600), "2m", "critical",
                  f"A process of {job} on {node} leaks memory and runs out within the hour.",
                  self._leak_description(job, node)),
            Alert("GpuwatchTrainingStalled",
                  self.per_job('kind="stalled"'),
                  "5m", "warning",
                  f"Training of {job} on {node} stopped taking steps while holding GPU memory.",
                  f"{_count('instrumented process', 'instrumented processes')} of {job} on "
                  f"{node} " + _agreeing("has", "have") + " not advanced a step:"
                  + self.listing('kind="stalled"', "PID " + process + ")" + SUMMARY)
                  + EVIDENCE),
            Alert("GpuwatchUnallocatedGpuMemory",
                  self.per_job('kind="unallocated"'),
                  "10m", "warning",
                  f"A process of {job} on {node} holds memory on a GPU its pod was not given.",
                  f"{_count('process', 'processes')} of {job} on {node} "
                  + _agreeing("holds", "hold") + " " + self.memory('kind="unallocated"')
                  + " on GPUs the kubelet allocated to other pods or to none: the pod runs "
                  "with every GPU visible (NVIDIA_VISIBLE_DEVICES=all, privileged) or the "
                  "device plugin handed a GPU out twice, and the pods given those GPUs will "
                  "run out of memory."
                  + self.listing('kind="unallocated"',
                                 "PID " + process + ", GPU {{ .Labels.gpu }})" + SUMMARY)
                  + EVIDENCE),
            Alert("GpuwatchUnkillableGpuProcess",
                  self.per_job('kind="unkillable", severity="critical"'),
                  "10m", "critical",
                  f"A process of {job} is stuck in the GPU driver on {node}; no signal frees "
                  "the GPU.",
                  f"{_count('process', 'processes')} of {job} on {node} "
                  + _agreeing("is", "are") + " in uninterruptible sleep holding GPU memory or "
                  "waiting in the NVIDIA driver:"
                  + self.listing('kind="unkillable", severity="critical"',
                                 "PID " + process + ")" + SUMMARY)
                  + EVIDENCE
                  + " Drain the node; it needs a GPU reset or a reboot."),
            Alert("GpuwatchUnkillableProcess",
                  self.per_job('kind="unkillable", severity="warning"'),
                  "30m", "warning",
                  f"A process of {job} on {node} is stuck in the kernel, outside the GPU "
                  "driver.",
                  f"{_count('process', 'processes')} of {job} on {node} "
                  + _agreeing("has", "have") + " been in uninterruptible sleep for long, "
                  "holding no GPU memory and not in the GPU driver (a hung network file "
                  "system, a dead disk):"
                  + self.listing('kind="unkillable", severity="warning"',
                                 "PID " + process + ")" + SUMMARY)
                  + EVIDENCE
                  + " The GPUs are not affected; the job will not end until the wait does."),
        ]

    def _leak_expr(self, within: int) -> str:
        soonest = (f"min by ({JOB_KEYS}) "
                   f"({self.m('gpuwatch_leak_projected_oom_timestamp_seconds')})")
        return self.pod_namespace(self.with_node(f"{soonest} - time() < {within}"))

    def _leak_description(self, job: str, node: str) -> str:
        query = ("gpuwatch_leak_growth_bytes_per_step{job=%q, instance=%q, job_id=%q}")
        return (f"The soonest of {job} on {node} runs out of memory in "
                "{{ $value | humanizeDuration }}."
                "{{ range printf `" + query + "` $labels.job $labels.instance $labels.job_id"
                " | query | sortByLabel \"pid\" }} PID {{ .Labels.pid }} ({{ .Labels.name }}): "
                "{{ .Labels.series }} grows {{ .Value | humanize1024 }}B a step"
                + _CULPRIT + ".{{ end }}")

    def reaper_alerts(self) -> list[Alert]:
        failed = self.m("gpuwatch_reaped_total", 'result=~"still-running|unkillable|failed"')
        return [
            Alert("GpuwatchReapFailed",
                  self.with_node(f"sum by ({NODE_KEYS}, kind, result) "
                                 f"(increase({failed}[30m])) > 0"),
                  "1m", "warning",
                  "gpuwatch could not reap a process on {{ $labels.node }}.",
                  "{{ $value | humanize }} reap " + _agreeing("action", "actions")
                  + " on {{ $labels.kind }} processes ended "
                  "`{{ $labels.result }}` on {{ $labels.node }} in the last 30 minutes: "
                  + _agreeing("the process is", "the processes are") + " still there. The "
                  "node's reap audit log (reap.jsonl) has the PIDs."),
        ]

    def daemon_alerts(self) -> list[Alert]:
        last_name = ("{{ with printf `last_over_time(gpuwatch_node_info{job=%q, instance=%q}"
                     "[1d])` $labels.job $labels.instance | query }}"
                     "{{ . | first | label \"node\" }}{{ else }}{{ $labels.instance }}{{ end }}")
        return [
            Alert("GpuwatchDown", f"up{{{self.s.selector}}} == 0", "5m", "warning",
                  f"Prometheus cannot scrape gpuwatch on {last_name}.",
                  f"gpuwatch on {last_name} ({{{{ $labels.instance }}}}) has not answered "
                  "scrapes for 5 minutes: leaks, orphans and zombies on this node go unseen."),
            # The level guard keeps CPU-only nodes quiet: NVML down only matters where NVIDIA
            # device files show the node has GPUs.
            Alert("GpuwatchNvmlDown",
                  self.with_node(f"{self.m('gpuwatch_nvml_up')} == 0\n"
                                 f"  and on ({NODE_KEYS}) "
                                 f"{self.m('gpuwatch_nvidia_device_files')} > 0"),
                  "5m", "critical", "NVML does not answer on GPU node {{ $labels.node }}.",
                  "gpuwatch on {{ $labels.node }} cannot read NVML although the node has "
                  "NVIDIA devices: the driver is gone or broken, and no job can use the GPUs. "
                  "`gpuwatch status` on the node gives NVML's own reason."),
            Alert("GpuwatchGpuUnreadable",
                  self.with_node(f"{self.m('gpuwatch_gpu_read_ok')} == 0\n"
                                 f"  and on ({NODE_KEYS}) {self.m('gpuwatch_nvml_up')} == 1"),
                  "5m", "warning", "GPU {{ $labels.gpu }} on {{ $labels.node }} fails NVML "
                  "calls.",
                  "GPU {{ $labels.gpu }} ({{ $labels.name }}, {{ $labels.uuid }}) on "
                  "{{ $labels.node }} fails NVML calls while the others answer: it may have "
                  "fallen off the bus (Xid 79)."),
            # The daemon answers scrapes from its latest poll; a poll stuck in NVML or /proc
            # leaves that poll ever older while `up` stays 1.
            Alert("GpuwatchPollStale",
                  self.with_node(f"time() - {self.m('gpuwatch_last_poll_timestamp_seconds')}"
                                 " > 120"),
                  "5m", "warning", "gpuwatch on {{ $labels.node }} serves an old snapshot.",
                  "gpuwatch on {{ $labels.node }} has not completed a poll for "
                  "{{ $value | humanizeDuration }}: its figures and findings are stale."),
            Alert("GpuwatchProcessSeriesDropped",
                  self.with_node(f"increase({self.m('gpuwatch_process_series_dropped_total')}"
                                 "[30m]) > 0"),
                  "30m", "info", "gpuwatch on {{ $labels.node }} drops per-process series.",
                  "gpuwatch on {{ $labels.node }} has more processes that matter than "
                  "exporter.max_process_series allows; dashboards miss some of them. Raise "
                  "the cap."),
        ]

    def groups(self) -> list[tuple[str, list[Alert]]]:
        return [("gpuwatch-findings", self.finding_alerts()),
                ("gpuwatch-reaper", self.reaper_alerts()),
                ("gpuwatch-daemon", self.daemon_alerts())]

    def runbook(self, name: str) -> str:
        return f"{self.s.runbook_url}#{name.lower()}"

    def for_(self, duration: str) -> str:
        if self.s.for_scale == 1.0:
            return duration
        return _duration(_seconds(duration) * self.s.for_scale)

    # -- YAML ----------------------------------------------------------------------------------
    def yaml(self) -> str:
        """The rule file. Written by hand (standard library only): short strings as JSON,
        which YAML reads as double-quoted scalars; expressions as literal blocks; descriptions
        as folded blocks, wrapped."""
        out = [
            "# Prometheus alerting rules for gpuwatch: built by dashboards/build.py from",
            "# dashboards/rules.py; edit those and rebuild (see docs/runbooks.md).",
            f"# Selector: {self.s.selector or '(none)'}",
            f"# Runbooks: {self.s.runbook_url}",
            "",
            "groups:",
        ]
        for group, alerts in self.groups():
            out += [f"  - name: {group}", "    rules:"]
            for a in alerts:
                out += [f"      - alert: {a.name}", "        expr: |-"]
                out += [f"          {line}" for line in a.expr.splitlines()]
                out += [f"        for: {self.for_(a.for_)}",
                        "        labels:",
                        f"          severity: {a.severity}",
                        "        annotations:",
                        f"          summary: {json.dumps(a.summary)}",
                        "          description: >-"]
                out += [f"            {line}" for line in _wrapped(a.description)]
                out += [f"          runbook_url: {json.dumps(self.runbook(a.name))}", ""]
        return "\n".join(out).rstrip() + "\n"

    def names(self) -> list[str]:
        return [a.name for _, alerts in self.groups() for a in alerts]


def _wrapped(text: str, width: int = 92) -> list[str]:
    """Lines for a folded block: folding joins them with single spaces, so wrap only at single
    spaces outside template actions (`{{ ... }}` stays on one line, for the reader's sake)."""
    assert not re.search(r"\s\s|\n", text), text
    kept = re.sub(r"\{\{.*?\}\}", lambda m: m.group(0).replace(" ", "\0"), text)
    return [line.replace("\0", " ") for line in
            textwrap.wrap(kept, width, break_long_words=False, break_on_hyphens=False)]


def parse_settings(selector: Optional[str], runbook_url: Optional[str],
                   for_scale: Optional[float]) -> Settings:
    kwargs: dict[str, Any] = {}
    if selector is not None:
        kwargs["selector"] = selector
    if runbook_url is not None:
        kwargs["runbook_url"] = runbook_url.rstrip("#")
    if for_scale is not None:
        if not 0 < for_scale <= 1:
            raise ValueError("--for-scale: a factor in (0, 1]")
        kwargs["for_scale"] = for_scale
    return Settings(**kwargs)
