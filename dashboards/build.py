"""Build the Grafana dashboards and the alert rules in this folder: `python dashboards/build.py`.

The JSON and YAML files next to this script are what users import; this script (and rules.py for
the alerts) is their source, so that every panel and rule gets the same datasource, selectors and
units from one place (the monitoring mixins do the same with jsonnet). The same rules and
dashboards go to deploy/kubernetes as a PrometheusRule and a ConfigMap for Grafana's sidecar.
`--check` fails when a file differs from what the script builds, which the test suite runs.

Settings, as a mixin's config: `--selector` (the series of your gpuwatch scrape job; default
`job="gpuwatch"`), `--runbook-url` (where the alerts' runbook links point), `--for-scale` (shorter
`for:` durations, for tests) and `--out` (another folder than this one).

Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from rules import Rules, Settings, parse_settings  # noqa: E402 - beside this script

SCHEMA_VERSION = 39  # Grafana 10.4 and 11
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
NODE_UID, FLEET_UID = "gpuwatch-node", "gpuwatch-fleet"

#: The selector every query on a node carries; the fleet dashboard's instance is a multi-value.
NODE = 'job=~"$job", instance=~"$instance"'
#: Per-process series narrowed to the training jobs picked in the `job_id` variable.
NODE_PROCESS = NODE + ', job_id=~"$job_id"'

Panel = dict[str, Any]


def target(expr: str, legend: str = "", ref: str = "A", table: bool = False) -> dict[str, Any]:
    t: dict[str, Any] = {"datasource": DATASOURCE, "expr": expr, "refId": ref}
    if table:  # one row per series, as of now
        t.update(format="table", instant=True, range=False)
    else:
        t.update(legendFormat=legend or "__auto", range=True)
    return t


def _panel(kind: str, title: str, description: str, targets: Sequence[dict[str, Any]],
           width: int, height: int, unit: Optional[str] = None, **extra: Any) -> Panel:
    defaults: dict[str, Any] = {}
    if unit is not None:
        defaults["unit"] = unit
    panel: Panel = {
        "type": kind, "title": title, "description": description, "datasource": DATASOURCE,
        "targets": list(targets), "gridPos": {"w": width, "h": height},
        "fieldConfig": {"defaults": defaults, "overrides": []}, "options": {},
    }
    for key, value in extra.items():
        if key == "defaults":
            defaults.update(value)
        else:
            panel[key] = value
    return panel


def timeseries(title: str, description: str, targets: Sequence[dict[str, Any]], unit: str,
               width: int = 12, stacked: bool = False, bars: bool = False) -> Panel:
    custom: dict[str, Any] = {"drawStyle": "bars" if bars else "line", "lineWidth": 1,
                              "fillOpacity": 30 if stacked or bars else 0, "showPoints": "never",
                              "stacking": {"mode": "normal" if stacked else "none",
                                           "group": "A"}}
    return _panel("timeseries", title, description, targets, width, 8, unit,
                  defaults={"custom": custom},
                  options={"legend": {"displayMode": "table", "placement": "right",
                                      "showLegend": True, "calcs": ["lastNotNull", "max"]},
                           "tooltip": {"mode": "multi", "sort": "desc"}})


def stat(title: str, description: str, expr: str, unit: str,
         thresholds: Sequence[tuple[Optional[float], str]] = ((None, "green"),),
         mappings: Sequence[dict[str, Any]] = ()) -> Panel:
    steps = [{"value": value, "color": color} for value, color in thresholds]
    return _panel("stat", title, description, [target(expr, table=False)], 4, 4, unit,
                  defaults={"thresholds": {"mode": "absolute", "steps": steps},
                            "mappings": list(mappings), "color": {"mode": "thresholds"}},
                  options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "",
                                             "values": False},
                           "colorMode": "background", "graphMode": "none",
                           "textMode": "value"})


def node_name(title: str, description: str, expr: str, legend: str) -> Panel:
    """A full-width line of text: the series' labels through `legend`, not its value."""
    return _panel("stat", title, description, [target(expr, legend)], 24, 3, "none",
                  defaults={"color": {"mode": "fixed", "fixedColor": "text"}},
                  options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "",
                                             "values": False},
                           "colorMode": "none", "graphMode": "none", "textMode": "name"})


def table(title: str, description: str, columns: Sequence[tuple[str, str, Optional[str]]],
          order: Sequence[str], width: int = 24, height: int = 8,
          links: Optional[dict[str, list[dict[str, str]]]] = None,
          sort_by: Optional[str] = None) -> Panel:
    """A table of series as of now, one query a value column: `columns` are
    (expr, header, unit), an empty header hiding the column (a query that only brings labels);
    `order` the label columns to show first, in order."""
    targets = [target(expr, ref=chr(ord("A") + i), table=True)
               for i, (expr, _, _) in enumerate(columns)]
    value_names = (["Value"] if len(columns) == 1
                   else [f"Value #{t['refId']}" for t in targets])
    renames = {name: header for name, (_, header, _) in zip(value_names, columns) if header}
    # The organize transformation indexes fields by their names before renaming.
    original = {header: name for name, header in renames.items()}
    shown = [original.get(column, column) for column in order]
    shown += [name for name in renames if name not in shown]
    overrides = [{"matcher": {"id": "byName", "options": header},
                  "properties": [{"id": "unit", "value": unit}]}
                 for _, header, unit in columns if unit is not None]
    for field, field_links in (links or {}).items():
        overrides.append({"matcher": {"id": "byName", "options": field},
                          "properties": [{"id": "links", "value": field_links}]})
    transformations: list[dict[str, Any]] = []
    if len(columns) > 1:
        transformations.append({"id": "merge", "options": {}})
    transformations.append({"id": "organize", "options": {
        "excludeByName": {"Time": True, "__name__": True, "job": True, "job_source": True,
                          "uuid": True, **{name: True for name, (_, header, _) in
                                           zip(value_names, columns) if not header}},
        "indexByName": {name: i for i, name in enumerate(shown)},
        "renameByName": renames,
    }})
    options: dict[str, Any] = {"showHeader": True, "cellHeight": "sm"}
    if sort_by is not None:
        options["sortBy"] = [{"displayName": sort_by, "desc": True}]
    panel = _panel("table", title, description, targets, width, height,
                   options=options, transformations=transformations)
    panel["fieldConfig"]["overrides"] = overrides
    return panel


def row(title: str) -> Panel:
    return {"type": "row", "title": title, "collapsed": False, "panels": [],
            "gridPos": {"w": 24, "h": 1}}


def _laid_out(panels: Iterable[Panel]) -> list[Panel]:
    """Left to right, wrapping at Grafana's 24 columns; a row starts a new line."""
    out: list[Panel] = []
    x = y = line_height = 0
    for i, panel in enumerate(panels, start=1):
        grid = panel["gridPos"]
        if panel["type"] == "row" or x + grid["w"] > 24:
            x, y, line_height = 0, y + line_height, 0
        grid.update(x=x, y=y)
        panel["id"] = i
        x += grid["w"]
        line_height = max(line_height, grid["h"])
        out.append(panel)
    return out


def _datasource_variable() -> dict[str, Any]:
    return {"name": "datasource", "label": "Data source", "type": "datasource",
            "query": "prometheus", "current": {}, "hide": 0, "includeAll": False,
            "multi": False, "options": [], "refresh": 1, "regex": ""}


def _query_variable(name: str, label: str, query: str, multi: bool = False,
                    include_all: bool = False) -> dict[str, Any]:
    variable = {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
                "query": {"query": query, "refId": f"{name}-variable"}, "definition": query,
                "current": {}, "hide": 0, "includeAll": include_all, "multi": multi,
                "options": [], "refresh": 2, "regex": "", "sort": 1}
    if include_all:
        variable["allValue"] = ".*"  # also matches series where the label is empty
    return variable


def named(expr: str, keys: str = "instance, job") -> str:
    """`expr` (which keeps `instance` and `job`) with the node's name as a `node` label."""
    return (f"({expr}) * on (instance, job) group_left (node) "
            f"max by ({keys}, node) (gpuwatch_node_info{{{NODE}}})")


def _node_variables(label: str, many: bool, settings: Settings) -> list[dict[str, Any]]:
    """Data source, scrape job (among those the selector setting admits), and the node (or
    nodes) of that job."""
    return [_datasource_variable(),
            _query_variable("job", "Scrape job",
                            f"label_values(gpuwatch_build_info{{{settings.selector}}}, job)"),
            _query_variable("instance", label,
                            'label_values(gpuwatch_build_info{job=~"$job"}, instance)',
                            multi=many, include_all=many)]


def _dashboard(uid: str, title: str, description: str, variables: list[dict[str, Any]],
               panels: Iterable[Panel], link_to: tuple[str, str]) -> dict[str, Any]:
    """`link_to`: the other dashboard's uid and title, linked with the same time range,
    data source and scrape job."""
    other_uid, other_title = link_to
    links = [{"title": other_title, "type": "link", "icon": "dashboard", "targetBlank": False,
              "keepTime": True, "includeVars": False, "tooltip": "",
              "url": f"/d/{other_uid}/{other_uid}?${{__url_time_range}}"
                     "&var-datasource=${datasource}&var-job=${job}"}]
    return {
        "uid": uid, "title": title, "description": description, "tags": ["gpuwatch", "gpu"],
        "schemaVersion": SCHEMA_VERSION, "version": 1, "editable": True,
        "graphTooltip": 1, "refresh": "30s", "time": {"from": "now-6h", "to": "now"},
        "timezone": "", "fiscalYearStartMonth": 0, "liveNow": False, "weekStart": "",
        "annotations": {"list": []}, "links": links,
        "templating": {"list": variables}, "panels": _laid_out(panels),
    }


def node_dashboard(settings: Settings) -> dict[str, Any]:
    selector, process = NODE, NODE_PROCESS
    # A Kubernetes pod's names follow the job: empty off Kubernetes.
    pod_columns = ["pod_namespace", "pod_name", "pod_container"]
    finding_columns = ["kind", "severity", "pid", "name", "user", "job_id", *pod_columns, "gpu"]
    process_columns = ["pid", "name", "user", "job_id", *pod_columns, "series", "culprit",
                       "found_by"]
    panels: list[Panel] = [
        row("Node"),
        stat("NVML", "Whether the daemon read NVML on its last poll. Down on a GPU node means "
             "the driver is gone; gpuwatch still watches host processes.",
             f"gpuwatch_nvml_up{{{selector}}}", "none",
             thresholds=((None, "red"), (1, "green")),
             mappings=[{"type": "value", "options": {"0": {"text": "down"},
                                                     "1": {"text": "up"}}}]),
        stat("GPU memory in use", "Used over total, summed over the node's GPUs.",
             f"sum(gpuwatch_gpu_memory_used_bytes{{{selector}}}) / "
             f"sum(gpuwatch_gpu_memory_total_bytes{{{selector}}})", "percentunit",
             thresholds=((None, "green"), (0.9, "orange"), (0.97, "red"))),
        stat("Unattributed GPU memory", "Used memory no process NVML lists accounts for: other "
             "PID namespaces, or contexts that outlived their process (see ghost findings).",
             f"sum(gpuwatch_gpu_unattributed_memory_bytes{{{selector}}})", "bytes",
             thresholds=((None, "green"), (1 << 30, "orange"))),
        stat("Open findings", "Orphans, zombies, leftovers, ghosts, leaks, stalls and "
             "unkillable processes open now; the table below says which and why.",
             f"sum(gpuwatch_findings{{{selector}}})", "none",
             thresholds=((None, "green"), (1, "orange"))),
        stat("GPU memory at stake", "GPU memory held by the processes of open findings: what "
             "reaping them would free.",
             f"sum(gpuwatch_finding_gpu_memory_bytes{{{selector}}}) or vector(0)", "bytes",
             thresholds=((None, "green"), (1, "orange"))),
        stat("Snapshot age", "How old the snapshot the daemon serves is. More than a few poll "
             "intervals means its poll loop is stuck (a hung NVML call).",
             f"time() - gpuwatch_last_poll_timestamp_seconds{{{selector}}}", "s",
             thresholds=((None, "green"), (60, "orange"), (120, "red"))),
        node_name("Node", "The node's name as its daemon reports it (daemon.node_name, else "
                  "the hostname), its driver and the gpuwatch version.",
                  f"gpuwatch_node_info{{{selector}}}",
                  "{{node}} · driver {{driver_version}} · CUDA {{cuda_driver_version}} · "
                  "gpuwatch {{version}}"),
        row("GPU memory"),
        timeseries("GPU memory by process", "Which PIDs hold how much GPU memory, summed "
                   "over GPUs. A PID that stays flat after its job ended is what the next job "
                   "runs out of memory against.",
                   [target(f"sum by (pid, name, job_id) (gpuwatch_process_gpu_memory_bytes"
                           f"{{{process}}})", "{{pid}} {{name}} {{job_id}}")],
                   "bytes", stacked=True),
        timeseries("GPU memory by job", "GPU memory summed by training job (Slurm job, "
                   "pod, container, torchelastic run); `(no job)` for processes of none.",
                   [target('sum by (job_id) (label_replace(gpuwatch_process_gpu_memory_bytes'
                           f'{{{process}}}, "job_id", "(no job)", "job_id", ""))',
                           "{{job_id}}")],
                   "bytes", stacked=True),
        timeseries("GPU memory per GPU", "Used, total, and the part of used memory no listed "
                   "process accounts for.",
                   [target(f"gpuwatch_gpu_memory_used_bytes{{{selector}}}",
                           "GPU {{gpu}} used", "A"),
                    target(f"gpuwatch_gpu_unattributed_memory_bytes{{{selector}}}",
                           "GPU {{gpu}} unattributed", "B"),
                    target(f"gpuwatch_gpu_memory_total_bytes{{{selector}}}",
                           "GPU {{gpu}} total", "C")],
                   "bytes"),
        timeseries("Host memory (RSS) by process", "Resident host memory of the processes "
                   "that matter: a line that climbs every step is a host-memory leak.",
                   [target(f"gpuwatch_process_resident_memory_bytes{{{process}}}",
                           "{{pid}} {{name}}")],
                   "bytes"),
        row("Findings"),
        table("Open findings", "Every open finding: what, which process and job, which GPU, "
              "and its evidence summed up from PIDs, process names and figures (`summary`). "
              "The PID and GPU memory are what `gpuwatch reap --dry-run --pid PID` on the node "
              "acts on; `gpuwatch status` there gives each one's full evidence (not served on "
              "/metrics: it quotes command lines).",
              [(f"gpuwatch_finding_info{{{selector}}}", "", None),
               (f"gpuwatch_finding_gpu_memory_bytes{{{selector}}}", "GPU memory", "bytes")],
              order=[*finding_columns, "GPU memory", "summary"], height=9,
              sort_by="GPU memory"),
        timeseries("Findings by kind", "Open findings over time, one line per kind.",
                   [target(f"gpuwatch_findings{{{selector}}}", "{{kind}}")], "none"),
        timeseries("GPU memory held by findings", "GPU memory at stake, by finding kind.",
                   [target(f"sum by (kind) (gpuwatch_finding_gpu_memory_bytes{{{selector}}})",
                           "{{kind}}")],
                   "bytes", stacked=True),
        row("Leaks and training progress"),
        timeseries("Leak growth per step", "How much the leaking series (RSS, GPU memory, or "
                   "a watched buffer) grows each training step; `culprit` is what explains it "
                   "and `found_by` how gpuwatch learnt it: a `watched` buffer, a container "
                   "the agent `discovered`, or an allocation site it `traced`.",
                   [target(f"gpuwatch_leak_growth_bytes_per_step{{{process}}}",
                           "{{pid}} {{name}} {{series}} {{culprit}} {{found_by}}")],
                   "bytes"),
        table("Projected out-of-memory", "When each leaking process runs out against its "
              "tightest limit (cgroup memory.max, MemAvailable, the GPU's total), with its "
              "culprit and how that was found (`found_by`).",
              [(f"gpuwatch_leak_projected_oom_step{{{process}}}", "OOM at step", "none"),
               (f"gpuwatch_leak_projected_oom_step{{{process}}} - on (instance, job, pid) "
                f"group_left gpuwatch_agent_step{{{selector}}}", "steps left", "none"),
               (f"gpuwatch_leak_projected_oom_timestamp_seconds{{{process}}} - time()",
                "time left", "s")],
              order=process_columns, width=12, sort_by="time left"),
        table("Leak culprits", "What explains each leak, and how gpuwatch found it "
              "(`found_by`): a buffer given to `agent.watch()` (`watched`), a growing "
              "container the agent found by itself (`discovered`), a tensor holding the "
              "autograd history of every step (`autograd`: its items are graph nodes; a leak "
              "of `autograd history` has no bytes), or the allocation site a trace of the "
              "process's allocations names (`traced`: the site, a source file and line, only "
              "in `gpuwatch status` on the node). With the culprit's own growth per step, "
              "where its bytes or items are known.",
              [(f"gpuwatch_leak_culprit_bytes_per_step{{{process}}}", "bytes/step", "bytes"),
               (f"gpuwatch_leak_culprit_items_per_step{{{process}}}", "items/step", "none")],
              order=["pid", "name", "series", "culprit", "found_by"], sort_by="bytes/step"),
        timeseries("Training steps per second", "Step rate reported by the in-process agent; "
                   "a line that drops to 0 while the process holds GPU memory is a stall.",
                   [target(f"rate(gpuwatch_agent_step{{{process}}}[$__rate_interval])",
                           "{{pid}} {{name}}")],
                   "none", width=8),
        timeseries("Watched buffers: bytes", "Bytes in each buffer given to `agent.watch()`.",
                   [target(f"gpuwatch_agent_buffer_bytes{{{process}}}",
                           "{{pid}} {{buffer}}")],
                   "bytes", width=8),
        timeseries("Watched buffers: items", "Items (len) of each watched buffer.",
                   [target(f"gpuwatch_agent_buffer_items{{{process}}}",
                           "{{pid}} {{buffer}}")],
                   "none", width=8),
        row("Reaps and daemon health"),
        table("Reaps since the daemon started", "Reap actions by finding kind and result, "
              "from the audit log: `gpuwatch reap` and the daemon's own.",
              [(f"sum by (kind, result) (gpuwatch_reaped_total{{{selector}}}) > 0", "actions",
                "none")],
              order=["kind", "result"], width=8),
        timeseries("Poll duration", "Wall time of the daemon's polls: median and 99th "
                   "percentile.",
                   [target("histogram_quantile(0.5, sum by (le) (rate("
                           f"gpuwatch_poll_duration_seconds_bucket{{{selector}}}"
                           "[$__rate_interval])))", "median", "A"),
                    target("histogram_quantile(0.99, sum by (le) (rate("
                           f"gpuwatch_poll_duration_seconds_bucket{{{selector}}}"
                           "[$__rate_interval])))", "p99", "B")],
                   "s", width=8),
        timeseries("Poll errors and rejected agent reports", "Per second: problems met while "
                   "polling (NVML calls failing, processes unreadable) and agent datagrams "
                   "the daemon refused, by reason.",
                   [target(f"sum by (source) (rate(gpuwatch_poll_errors_total{{{selector}}}"
                           "[$__rate_interval]))", "poll error: {{source}}", "A"),
                    target("sum by (reason) (rate(gpuwatch_agent_reports_rejected_total"
                           f"{{{selector}}}[$__rate_interval]))", "rejected: {{reason}}", "B"),
                    target(f"rate(gpuwatch_agent_reports_total{{{selector}}}"
                           "[$__rate_interval])", "agent reports accepted", "C")],
                   "none", width=8),
    ]
    variables = [
        *_node_variables("Node", many=False, settings=settings),
        _query_variable("job_id", "Training job",
                        "label_values(gpuwatch_process_gpu_memory_bytes"
                        '{job=~"$job", instance=~"$instance"}, job_id)',
                        multi=True, include_all=True),
    ]
    return _dashboard(NODE_UID, "gpuwatch / node",
                      "One GPU node: who holds GPU memory, what gpuwatch found and why, leaks "
                      "by training step, reaps and the daemon's own health.",
                      variables, panels, link_to=(FLEET_UID, "gpuwatch fleet"))


def fleet_dashboard(settings: Settings) -> dict[str, Any]:
    selector = NODE
    # Every fleet table row has the node's instance: the node dashboard is selected by it.
    to_node = [{"title": "Open ${__data.fields.node} in the node dashboard",
                "url": f"/d/{NODE_UID}/{NODE_UID}?${{__url_time_range}}"
                       "&var-datasource=${datasource}&var-job=${job}"
                       "&var-instance=${__data.fields.instance}"}]
    panels: list[Panel] = [
        row("Fleet"),
        stat("Nodes reporting", "Nodes whose gpuwatch answered the last scrape.",
             f"count(up{{{selector}}} == 1) or vector(0)", "none"),
        stat("Nodes down", "Nodes whose gpuwatch did not answer the last scrape.",
             f"count(up{{{selector}}} == 0) or vector(0)", "none",
             thresholds=((None, "green"), (1, "red"))),
        stat("Nodes with NVML down", "Nodes where gpuwatch runs but NVML does not answer.",
             f"count(gpuwatch_nvml_up{{{selector}}} == 0) or vector(0)", "none",
             thresholds=((None, "green"), (1, "red"))),
        stat("Nodes with findings", "Nodes with at least one open finding of any kind.",
             f"count(sum by (instance) (gpuwatch_findings{{{selector}}}) > 0) or vector(0)",
             "none", thresholds=((None, "green"), (1, "orange"))),
        stat("GPU memory stranded", "GPU memory held by orphans and leftovers across the "
             "fleet: capacity no job can use until they are reaped.",
             f'sum(gpuwatch_finding_gpu_memory_bytes{{{selector}, kind=~"orphan|leftover"}})'
             " or vector(0)", "bytes", thresholds=((None, "green"), (1, "orange"))),
        stat("Heading for OOM within 6 h", "Leaking processes whose projected out-of-memory "
             "time is less than 6 hours away.",
             "count(gpuwatch_leak_projected_oom_timestamp_seconds"
             f"{{{selector}}} - time() < 6 * 3600) or vector(0)", "none",
             thresholds=((None, "green"), (1, "red"))),
        timeseries("GPU memory held by orphans and leftovers, per node", "Stranded GPU memory "
                   "by node: a node that stays up here fails the next job placed on it.",
                   [target(named("sum by (instance, job) (gpuwatch_finding_gpu_memory_bytes"
                                 f'{{{selector}, kind=~"orphan|leftover"}})'), "{{node}}")],
                   "bytes", stacked=True),
        timeseries("Open findings by kind", "Open findings summed over the fleet.",
                   [target(f"sum by (kind) (gpuwatch_findings{{{selector}}})", "{{kind}}")],
                   "none"),
        timeseries("GPU memory at stake in findings, per Kubernetes namespace", "GPU memory "
                   "held by processes with an open finding, by their pod's namespace: the "
                   "team to ask. Processes in no pod are `(no pod)`.",
                   [target("sum by (pod_namespace) (label_replace("
                           f"gpuwatch_finding_gpu_memory_bytes{{{selector}}}, "
                           '"pod_namespace", "(no pod)", "pod_namespace", ""))',
                           "{{pod_namespace}}")],
                   "bytes", stacked=True),
        table("Nodes with findings", "Open findings by node and kind, with the GPU memory at "
              "stake. The node name opens its node dashboard.",
              [(named(f"sum by (instance, job, kind) (gpuwatch_findings{{{selector}}}) > 0"),
                "findings", "none"),
               (named("sum by (instance, job, kind) (gpuwatch_finding_gpu_memory_bytes"
                      f"{{{selector}}})"), "GPU memory", "bytes")],
              order=["node", "kind", "instance"], width=12, links={"node": to_node},
              sort_by="GPU memory"),
        table("Top leaking jobs", "Training jobs whose processes leak the most per step, and "
              "the soonest projected out-of-memory among their processes.",
              [(named("topk(10, sum by (instance, job, job_id, pod_namespace, pod_name) ("
                      "label_replace("
                      f'gpuwatch_leak_growth_bytes_per_step{{{selector}}}, "job_id", '
                      '"(no job)", "job_id", "")))'), "growth per step", "bytes"),
               (named("min by (instance, job, job_id, pod_namespace, pod_name) (label_replace("
                      f'gpuwatch_leak_projected_oom_timestamp_seconds{{{selector}}}, "job_id", '
                      '"(no job)", "job_id", "")) - time()'), "time to OOM", "s")],
              order=["job_id", "pod_namespace", "pod_name", "node", "instance"], width=12,
              links={"node": to_node},
              sort_by="growth per step"),
        timeseries("GPU memory in use and unattributed, per node", "Used GPU memory by node, "
                   "and the part no listed process accounts for.",
                   [target(named("sum by (instance, job) (gpuwatch_gpu_memory_used_bytes"
                                 f"{{{selector}}})"), "{{node}} used", "A"),
                    target(named("sum by (instance, job) (gpuwatch_gpu_unattributed_memory_bytes"
                                 f"{{{selector}}})"), "{{node}} unattributed", "B")],
                   "bytes"),
        timeseries("Reaps across the fleet", "Reap actions by node and result.",
                   [target(named("sum by (instance, job, result) (increase("
                                 f"gpuwatch_reaped_total{{{selector}}}[$__rate_interval]))"),
                           "{{node}} {{result}}")],
                   "none", bars=True),
        timeseries("Poll duration p99, per node", "A node whose polls slow down has a slow "
                   "driver or a process storm.",
                   [target(named("histogram_quantile(0.99, sum by (instance, job, le) (rate("
                                 f"gpuwatch_poll_duration_seconds_bucket{{{selector}}}"
                                 "[$__rate_interval])))"), "{{node}}")],
                   "s", width=24),
    ]
    return _dashboard(FLEET_UID, "gpuwatch / fleet",
                      "Every GPU node at once: stranded GPU memory, nodes with findings, the "
                      "jobs leaking most, reaps and nodes that stopped reporting.",
                      _node_variables("Nodes", many=True, settings=settings), panels,
                      link_to=(NODE_UID, "gpuwatch node"))


DASHBOARDS: dict[str, Callable[[Settings], dict[str, Any]]] = {
    "gpuwatch-node.json": node_dashboard, "gpuwatch-fleet.json": fleet_dashboard}
RULES = "gpuwatch-alerts.yml"
#: The Kubernetes objects built from the same source, in their own folder (deploy/kubernetes
#: beside this one; `kubernetes/` under --out).
KUBERNETES = "kubernetes"
K8S_RULES = f"{KUBERNETES}/prometheusrule.yaml"
K8S_DASHBOARDS = f"{KUBERNETES}/grafana-dashboards.yaml"
K8S_DEFAULT_OUT = HERE.parent / "deploy" / "kubernetes"
#: The labels kube-prometheus-stack's Prometheus and Grafana select by default (a Helm release
#: named kube-prometheus-stack); docs/kubernetes.md says how to change them.
K8S_LABELS = ("  labels:\n"
              "    app.kubernetes.io/name: gpuwatch\n"
              "    app.kubernetes.io/part-of: gpuwatch\n")


def _indented(text: str, spaces: int) -> list[str]:
    return [(" " * spaces + line) if line else "" for line in text.splitlines()]


def prometheus_rule(rules_yaml: str) -> str:
    """The rule file as the Prometheus Operator's PrometheusRule: its groups under `spec`."""
    body = rules_yaml[rules_yaml.index("groups:\n"):]
    out = ["# The alert rules of dashboards/gpuwatch-alerts.yml as a Prometheus Operator object,",
           "# built by dashboards/build.py from dashboards/rules.py: edit those and rebuild.",
           "apiVersion: monitoring.coreos.com/v1",
           "kind: PrometheusRule",
           "metadata:",
           "  name: gpuwatch",
           K8S_LABELS + "    release: kube-prometheus-stack",
           "spec:",
           *_indented(body, 2)]
    return "\n".join(out) + "\n"


def dashboards_configmap(boards: dict[str, str]) -> str:
    """The dashboards as one ConfigMap that Grafana's dashboard sidecar (kube-prometheus-stack's
    default) loads: it picks ConfigMaps labelled grafana_dashboard=1."""
    out = ["# The Grafana dashboards of dashboards/ for Grafana's sidecar, built by",
           "# dashboards/build.py: edit it and rebuild.",
           "apiVersion: v1",
           "kind: ConfigMap",
           "metadata:",
           "  name: gpuwatch-dashboards",
           K8S_LABELS + '    grafana_dashboard: "1"',
           "  annotations:",
           "    # The folder, where the sidecar is set up with folderAnnotation: grafana_folder.",
           "    grafana_folder: gpuwatch",
           "data:"]
    for name, text in boards.items():
        out += [f"  {name}: |-", *_indented(text.rstrip("\n"), 4)]
    return "\n".join(out) + "\n"


def rendered(settings: Settings) -> dict[str, str]:
    """Every file this script writes, by name (the Kubernetes ones under `kubernetes/`)."""
    files = {name: json.dumps(build(settings), indent=2) + "\n"
             for name, build in DASHBOARDS.items()}
    files[RULES] = Rules(settings).yaml()
    files[K8S_RULES] = prometheus_rule(files[RULES])
    files[K8S_DASHBOARDS] = dashboards_configmap({name: files[name] for name in DASHBOARDS})
    return files


def destination(out: Path, name: str) -> Path:
    """Where a file goes: the Kubernetes ones into deploy/kubernetes when writing beside this
    script, into a `kubernetes` folder under any other --out."""
    if name.startswith(f"{KUBERNETES}/"):
        base = K8S_DEFAULT_OUT if out.resolve() == HERE else out / KUBERNETES
        return base / name.split("/", 1)[1]
    return out / name


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a file differs from what this script builds")
    parser.add_argument("--selector", help="PromQL label matchers that select gpuwatch's "
                        "series and its targets' `up` (default: job=\"gpuwatch\")")
    parser.add_argument("--runbook-url", help="where docs/runbooks.md is read; each alert "
                        "links to its section (default: the project's own)")
    parser.add_argument("--for-scale", type=float, metavar="FACTOR",
                        help="multiply every alert's `for:` by FACTOR (0 < FACTOR <= 1; at "
                             "least 1 s), for tests")
    parser.add_argument("--out", type=Path, default=HERE, help="folder to write to "
                        "(default: this one)")
    args = parser.parse_args(argv)
    try:
        settings = parse_settings(args.selector, args.runbook_url, args.for_scale)
    except ValueError as exc:
        parser.error(str(exc))
    stale = []
    for name, text in rendered(settings).items():
        path = destination(args.out, name)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run `python dashboards/build.py`",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
