"""The types of the status document (`gpuwatch status --json`, the daemon's state socket), for
scripts that read it: `doc: StatusDocument = json.loads(text)`.

gpuwatch/sinks/document.py builds the document as these types, and mypy checks it does
(`make test`), so the types cannot drift from what is printed. docs/json.md describes every
field; a value NVML or /proc could not give is None (`null`), never 0. A new field may appear in
a later version without `schema` changing; an incompatible change bumps `schema`.
"""

from __future__ import annotations

from typing import Any, Optional, TypedDict

__all__ = [
    "AgentDoc",
    "BufferDoc",
    "ExecutableDoc",
    "FindingDoc",
    "GpuDoc",
    "GpuErrorDoc",
    "GpuUsageDoc",
    "JobDoc",
    "NvmlDoc",
    "PollErrorDoc",
    "ProcessDoc",
    "StatusDocument",
]


class _JobId(TypedDict):
    id: str
    #: "slurm", "kubernetes", "gpuwatch-run", "torchelastic", ... (docs/json.md).
    source: str


class JobDoc(_JobId, total=False):
    #: A Kubernetes pod's namespace and name, and the process's container (null where the
    #: runtime did not say): present only where the node names the pod (docs/kubernetes.md).
    namespace: str
    pod: str
    container: Optional[str]


class NvmlDoc(TypedDict):
    available: bool
    error: Optional[str]
    error_code: Optional[int]
    driver_version: Optional[str]
    nvml_version: Optional[str]
    cuda_driver_version: Optional[str]
    device_count: Optional[int]


class GpuErrorDoc(TypedDict):
    call: str
    code: Optional[int]
    message: str


class GpuDoc(TypedDict):
    index: int
    uuid: Optional[str]
    name: Optional[str]
    pci_bus_id: Optional[str]
    memory_total_bytes: Optional[int]
    memory_used_bytes: Optional[int]
    memory_free_bytes: Optional[int]
    memory_reserved_bytes: Optional[int]
    unattributed_memory_bytes: Optional[int]
    utilization_gpu_percent: Optional[int]
    utilization_memory_percent: Optional[int]
    mig_enabled: Optional[bool]
    process_count: int
    holders_unknown: bool
    lost: bool
    errors: list[GpuErrorDoc]


class GpuUsageDoc(TypedDict):
    index: int
    uuid: Optional[str]
    memory_bytes: Optional[int]
    #: "compute", "graphics" or "compute+graphics".
    type: str
    gpu_instance_id: Optional[int]
    compute_instance_id: Optional[int]


class BufferDoc(TypedDict):
    items: Optional[int]
    bytes: Optional[int]


class AgentDoc(TypedDict):
    step: Optional[int]
    step_changed_at: Optional[float]
    first_seen: Optional[float]
    last_seen: Optional[float]
    finished_at: Optional[float]
    rss_bytes: Optional[int]
    cuda_allocated_bytes: Optional[int]
    cuda_reserved_bytes: Optional[int]
    cuda_active_bytes: Optional[int]
    cuda_allocations: Optional[int]
    buffers: dict[str, BufferDoc]
    #: What keeps the process alive at interpreter exit (docs/agent.md), once reported.
    exit: Optional[dict[str, Any]]


class ExecutableDoc(TypedDict):
    #: As /proc/PID/exe names it (" (deleted)" at the end once that path no longer does).
    path: str
    owner_uid: int
    #: The file at `path` is the one the process runs, and it and every directory above it are
    #: root's alone (docs/security.md, rule 2).
    root_controlled: bool


class ProcessDoc(TypedDict):
    pid: int
    ppid: Optional[int]
    pgid: Optional[int]
    sid: Optional[int]
    job_root: Optional[int]
    start_time: Optional[float]
    name: Optional[str]
    user: Optional[str]
    uid: Optional[int]
    state: Optional[str]
    rss_bytes: Optional[int]
    #: Private memory (smaps_rollup), read for the forked workers of GPU jobs only.
    uss_bytes: Optional[int]
    pss_bytes: Optional[int]
    num_threads: Optional[int]
    gpu_memory_bytes: Optional[int]
    gpus: list[GpuUsageDoc]
    #: None: unknown (every GPU it was seen on has an unreadable process list this poll).
    holds_gpu: Optional[bool]
    job: Optional[JobDoc]
    cgroup: Optional[str]
    #: The unit systemd's system manager started it in; None where its cgroup names none.
    system_unit: Optional[str]
    #: The file it runs; None where /proc/PID/exe could not be read.
    exe: Optional[ExecutableDoc]
    launch_env: dict[str, str]
    cmdline: list[str]
    in_procfs: bool
    read_errors: list[str]
    wchan: Optional[str]
    kernel_stack: list[str]
    agent: Optional[AgentDoc]


class FindingDoc(TypedDict):
    #: orphan, zombie, leftover, ghost, unkillable, leak or stalled (docs/findings.md).
    kind: str
    severity: str
    pid: Optional[int]
    start_time: Optional[float]
    name: Optional[str]
    user: Optional[str]
    job: Optional[JobDoc]
    gpus: list[int]
    gpu_memory_bytes: Optional[int]
    reason: str
    #: The reason from identity and figures only: what /metrics serves (docs/json.md).
    summary: str
    since: float
    #: The kind's own evidence (docs/json.md lists it per kind).
    details: dict[str, Any]


class PollErrorDoc(TypedDict):
    source: str
    message: str


class StatusDocument(TypedDict):
    schema: int
    gpuwatch_version: str
    #: "daemon" (a running daemon's view, with history) or "poll" (one poll of the command's own).
    source: str
    source_detail: Optional[str]
    node: str
    taken_at: float
    poll_duration_seconds: float
    nvml: NvmlDoc
    gpus: list[GpuDoc]
    processes: list[ProcessDoc]
    findings: list[FindingDoc]
    errors: list[PollErrorDoc]
