"""The per-process series of /metrics: their labels, and one process's rows, kept while the
process is unchanged.

Most of a node's processes show the same figures from one poll to the next; their records (and
their agents' readings) are then the same immutable objects. ReportCollector keeps each
exported process's rows while what they are made of is equal (as DocumentWriter keeps each
process's JSON), and exposition_text.LineWriter keeps those rows' lines by identity: a render
writes again only the processes that changed.
"""

from __future__ import annotations

from itertools import islice
from typing import Optional

from gpuwatch.model import COMM_CHARS, AgentReading, HostProcess, Job
from gpuwatch.sinks.exposition_text import Row, row

# Label names for a process. `job_id`, not `job`: Prometheus owns `job` (the scrape job) and
# would rename ours to `exported_job` (docs/design-notes.md).
# A Kubernetes pod's names are `pod_namespace`, `pod_name`, `pod_container`, not `namespace`,
# `pod`, `container`: the Prometheus Operator gives every series of a scrape those of the
# scraped pod (gpuwatch's own), and would rename ours to `exported_namespace` and the like. The
# alert rules copy `pod_namespace` into the alert's `namespace` for Alertmanager's routes.
PROCESS_LABELS = ("pid", "name", "user", "job_id", "job_source", "pod_namespace", "pod_name",
                  "pod_container")


def process_labels(pid: Optional[int], name: Optional[str], user: Optional[str],
                   job: Optional[Job]) -> list[str]:
    """pid, name, user, job_id, job_source, and a pod's namespace, name and container (empty
    off Kubernetes, or until the node names the pod). The name is the kernel's (`comm`, 15
    characters), as `ps` shows it to anyone: psutil's longer one goes on with argv[0], a command
    line's."""
    return [
        str(pid) if pid is not None else "",
        (name or "")[:COMM_CHARS],
        user or "",
        job.id if job else "",
        job.source if job else "",
        (job.namespace or "") if job else "",
        (job.pod or "") if job else "",
        (job.container or "") if job else "",
    ]


GPU_PROCESS_LABELS = (*PROCESS_LABELS, "gpu", "uuid")
BUFFER_LABELS = (*PROCESS_LABELS, "buffer")


#: One exported process's rows for the per-process families, in the order
#: ReportCollector._processes yields them: GPU memory, RSS, start time, step, step time, buffer
#: items, buffer bytes.
ProcessFamilies = tuple[list[Row], list[Row], list[Row], list[Row], list[Row], list[Row],
                        list[Row]]
PROCESS_FAMILIES = 7


def process_rows(p: HostProcess, job: Optional[Job], agent: Optional[AgentReading], fit: int,
                 started: Optional[float], stepped: Optional[float]) -> ProcessFamilies:
    """A process's rows, made of its record, its job, its agent's reading, how many buffers its
    user's share lets it export (`fit`) and its two times on the wall clock: nothing else, so
    a collector keeps them while those are equal (records and readings are immutable, replaced
    when anything in them changes)."""
    base = process_labels(p.pid, p.name, p.user, job)
    gpu_mem = [row([*base, str(u.gpu_index), u.gpu_uuid or ""], float(u.memory_bytes))
               for u in p.gpu_usage if u.memory_bytes is not None]
    rss = [row(base, float(p.rss_bytes))] if p.rss_bytes is not None else []
    start = [row(base, started)] if started is not None else []
    steps: list[Row] = []
    step_at: list[Row] = []
    items: list[Row] = []
    sizes: list[Row] = []
    if agent is not None and agent.step is not None:
        steps.append(row(base, float(agent.step)))
        if stepped is not None:
            step_at.append(row(base, stepped))
    if agent is not None and agent.latest is not None:
        for name, size in islice(agent.latest.buffers.items(), fit):
            if size.items is not None:
                items.append(row([*base, name], float(size.items)))
            if size.bytes is not None:
                sizes.append(row([*base, name], float(size.bytes)))
    return gpu_mem, rss, start, steps, step_at, items, sizes
