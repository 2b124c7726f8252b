"""The node snapshot: one immutable picture of a GPU node per poll.

Sources (NVML, /proc) each produce a part; `gpuwatch.poll` joins them into a `NodeSnapshot`;
detectors, the exporter and the CLI only ever read snapshots.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import field
from functools import cached_property
from types import MappingProxyType
from typing import Any, NamedTuple, Optional

# Frozen dataclasses with three of the six generated methods shared: `gpuwatch status --poll`
# imports this module on every run.
from gpuwatch.evidence import Details
from gpuwatch.frozen import frozen_dataclass as _frozen

# The finding kinds, as the model has always named them (gpuwatch.vocabulary holds them).
from gpuwatch.vocabulary import KINDS as KINDS
from gpuwatch.vocabulary import REAPABLE_KINDS as REAPABLE_KINDS
from gpuwatch.vocabulary import Kind as Kind
from gpuwatch.vocabulary import ProcState, Severity, TraceStatus

#: Kinds of NVML process lists a PID was found in.
COMPUTE = "compute"
GRAPHICS = "graphics"


@_frozen
class NvmlCallError:
    """One NVML call that failed, kept so that a partial read says what is missing and why."""

    call: str
    code: int
    message: str

    def __str__(self) -> str:
        return f"{self.call}: {self.message}"


@_frozen
class SourceError:
    """A problem a source met during a poll; counted by source in the exporter."""

    source: str  # "nvml" | "procfs"
    message: str


@_frozen
class GpuProcessUsage:
    """One PID in one device's NVML process lists."""

    gpu_index: int
    gpu_uuid: Optional[str]
    pid: int
    #: None when NVML reports the figure as not available (it is unknown, not zero).
    memory_bytes: Optional[int]
    kinds: frozenset[str] = frozenset({COMPUTE})
    #: MIG instance ids; None on a GPU without MIG.
    gpu_instance_id: Optional[int] = None
    compute_instance_id: Optional[int] = None

    @property
    def kind(self) -> str:
        return "+".join(sorted(self.kinds))


@_frozen
class GpuDevice:
    """One GPU as NVML described it in one poll; a field whose call failed stays None."""

    index: int
    uuid: Optional[str] = None
    name: Optional[str] = None
    pci_bus_id: Optional[str] = None
    memory_total_bytes: Optional[int] = None
    memory_used_bytes: Optional[int] = None
    memory_free_bytes: Optional[int] = None
    memory_reserved_bytes: Optional[int] = None
    utilization_gpu_percent: Optional[int] = None
    utilization_memory_percent: Optional[int] = None
    mig_enabled: Optional[bool] = None
    processes: tuple[GpuProcessUsage, ...] = ()
    #: Calls that failed on this device; the fields they would fill stay None.
    errors: tuple[NvmlCallError, ...] = ()
    #: True when the device answered GPU_IS_LOST: it needs a reset, nothing on it is trustworthy.
    lost: bool = False

    @property
    def ok(self) -> bool:
        return not self.errors

    @cached_property  # (these three: asked several times a poll, worked out once a record)
    def process_list_unread(self) -> bool:
        """A process list was asked for and could not be read (or the GPU is lost)."""
        return self.lost or any("RunningProcesses" in e.call for e in self.errors)

    @cached_property
    def holders_unknown(self) -> bool:
        """Who holds memory on this GPU is not known: a process list could not be read, the GPU
        is lost, or not even its handle could be had (so no list was asked for)."""
        return self.process_list_unread or any(e.call.startswith("nvmlDeviceGetHandle")
                                               for e in self.errors)

    @property
    def attributed_memory_bytes(self) -> int:
        return sum(p.memory_bytes or 0 for p in self.processes)

    @cached_property
    def unattributed_memory_bytes(self) -> Optional[int]:
        """Used memory that no listed process accounts for (driver reservations excluded).

        None when the device's used memory, or any process's figure, is unknown, or when a
        process list could not be read (the holders it would have listed are unknown too).
        """
        if self.memory_used_bytes is None:
            return None
        if self.holders_unknown:
            return None
        if any(p.memory_bytes is None for p in self.processes):
            return None
        return max(0, self.memory_used_bytes - self.attributed_memory_bytes)


@_frozen
class NvmlStatus:
    """Whether NVML answered in a poll, and the driver it reported."""

    available: bool
    #: Why NVML is unavailable, readable as it is: "NVML Shared Library Not Found".
    error: Optional[str] = None
    error_code: Optional[int] = None
    driver_version: Optional[str] = None
    nvml_version: Optional[str] = None
    cuda_driver_version: Optional[str] = None
    device_count: Optional[int] = None
    #: While NVML is unavailable: how many /dev/nvidiaN device files the node has. More than
    #: none means a GPU node whose driver is broken, none a CPU-only node.
    device_files: Optional[int] = None

    @property
    def message(self) -> str:
        if self.available:
            return f"NVML {self.nvml_version or '?'}, driver {self.driver_version or '?'}"
        return f"NVML unavailable: {self.error or 'unknown reason'}"


@_frozen
class NvmlReading:
    """What the NVML source produced in one poll."""

    status: NvmlStatus
    gpus: tuple[GpuDevice, ...] = ()
    errors: tuple[SourceError, ...] = ()


@_frozen
class Job:
    """The job a process belongs to, and where that was learnt."""

    id: str
    #: "slurm", "run", "torchelastic", "torchrun", "ray", "kubernetes", "container" or "systemd".
    source: str
    #: A Kubernetes pod's namespace, name and the process's container name, where the node says
    #: (gpuwatch.sources.pods): the names a person and an alert route go by. They arrive a poll
    #: after the UID: a job with them compares unequal to the same job without (what renders it
    #: must render it again), but hashes the same; what tells one job from another where that
    #: matters (`reap --job`, a finding's identity, a job tree) is the id.
    namespace: Optional[str] = field(default=None, repr=False, hash=False)
    pod: Optional[str] = field(default=None, repr=False, hash=False)
    container: Optional[str] = field(default=None, repr=False, hash=False)

    def __str__(self) -> str:
        return f"{self.source}:{self.id}"

    @property
    def pod_name(self) -> Optional[str]:
        """NAMESPACE/NAME of a pod's job whose names are known, else None."""
        if self.namespace and self.pod:
            return f"{self.namespace}/{self.pod}"
        return None

    @property
    def shown(self) -> str:
        """What a person reads: NAMESPACE/NAME[/CONTAINER] for a named pod, else source:id."""
        named = self.pod_name
        if named is None:
            return str(self)
        return f"{named}/{self.container}" if self.container else named


@_frozen
class Executable:
    """The file a process runs, from /proc/PID/exe: facts its user cannot set (its `comm` and
    command line they can). Read when the process is first seen, and again after each exec."""

    #: Where the file was when the process executed it, as the kernel gives it (symbolic links
    #: resolved; " (deleted)" at the end when that path no longer names the file).
    path: str
    #: The owner of the very file the process runs (stat through the link, not through the path).
    owner_uid: int
    #: Whether root alone could have put this file at `path`: the path names the very file the
    #: process runs in gpuwatch's own view of the file system (same device and inode), and the
    #: file and every directory above it are owned by root and writable by neither group nor
    #: others. A user's own copy, a hard link in /tmp, a file bind-mounted in a user's own mount
    #: namespace, or a file deleted since it was executed: False.
    root_controlled: bool


#: The kernel's name of a process (`comm`) is at most 15 bytes; a longer `HostProcess.name` is
#: psutil's, completed from the basename of argv[0], which is part of the command line.
COMM_CHARS = 15


@_frozen
class Pod:
    """A Kubernetes pod of the node as the kubelet and the container runtime describe it."""

    uid: str
    namespace: str
    name: str
    #: Each container's GPU devices as the kubelet allocated them (PodResources: device plugin
    #: ids, GPU or MIG UUIDs, or indexes), by container name; empty where the kubelet did not say.
    allocated: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: MappingProxyType({}))
    #: True when the kubelet's last answer listed it; False when its last two answers did not
    #: (it is gone from the node's pods); None when the kubelet did not answer.
    listed: Optional[bool] = None
    #: When the kubelet was first seen answering without it (steady clock), while not `listed`.
    gone_since: Optional[float] = None
    #: Names from "kubelet" (PodResources, pod log directories), "pod-logs", "containerd", "cri-o".
    source: str = "kubelet"
    #: Whether a container of it was given devices by Dynamic Resource Allocation, which the
    #: kubelet names by claim, not by GPU: its GPUs are then not known from `allocated`.
    dynamic_resources: bool = False

    @property
    def full_name(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def gpu_devices(self) -> frozenset[str]:
        """Every device id allocated to any of its containers."""
        return frozenset(d for ds in self.allocated.values() for d in ds)


@_frozen
class HostProcess:
    """One process as /proc described it in one poll."""

    pid: int
    #: False when NVML lists the PID and /proc has none: another PID namespace, or it exited.
    in_procfs: bool = True
    ppid: Optional[int] = None
    #: Process group and session: Ctrl+C reaches a process group; a login shell leads a session.
    pgid: Optional[int] = None
    sid: Optional[int] = None
    #: Seconds since the epoch; with `pid` it identifies a process across PID reuse.
    start_time: Optional[float] = None
    name: Optional[str] = None
    #: Command line with secrets redacted.
    cmdline: tuple[str, ...] = ()
    user: Optional[str] = None
    uid: Optional[int] = None
    state: Optional[ProcState] = None
    rss_bytes: Optional[int] = None
    num_threads: Optional[int] = None
    cgroup: Optional[str] = None
    #: The unit systemd's system manager started it in ("nvidia-persistenced.service",
    #: "session-3.scope"): the first unit of its cgroup path below slices only, which only root
    #: creates. A user's own units (under user@UID.service) are never this. None when the
    #: cgroup path names no such unit (a Slurm job's, a container's, or no systemd).
    system_unit: Optional[str] = None
    #: The file it runs; None where /proc/PID/exe could not be read (another user's process
    #: without CAP_SYS_PTRACE, a kernel thread, a zombie).
    exe: Optional[Executable] = None
    job: Optional[Job] = None
    #: The Kubernetes pod its cgroup names, by UID (set by the poll; NodeSnapshot.pods has
    #: what the node says of it).
    pod_uid: Optional[str] = None
    #: The id of the container its cgroup names (64 hex), the one the node's runtime knows.
    container_id: Optional[str] = None
    #: Distributed-launch variables from the environment (LOCAL_RANK, RANK, SLURM_PROCID, ...):
    #: evidence that this is a training worker. Nothing else of the environment is kept.
    launch_env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    #: Its PIDs in the nested PID namespaces it lives in (a container's), outermost first; empty
    #: in the namespace gpuwatch reads /proc from. A PID that a process inside a container wrote
    #: down (GPUWATCH_RUN_SUPERVISOR) is one of these, not the host's.
    namespace_pids: tuple[int, ...] = ()
    gpu_usage: tuple[GpuProcessUsage, ...] = ()
    #: What could not be read about this process (permission, vanished mid-read).
    read_errors: tuple[str, ...] = ()
    #: Where a process in uninterruptible sleep waits in the kernel: its wait channel
    #: (/proc/PID/wchan) and, where readable (root), its kernel stack. Read for D state only.
    wchan: Optional[str] = None
    kernel_stack: tuple[str, ...] = ()
    #: Private memory from /proc/PID/smaps_rollup: USS (Private_Clean + Private_Dirty, the
    #: pages no other process maps) and PSS. Read only for the forked workers of GPU jobs (a
    #: DataLoader's), where copy-on-write hides behind a flat RSS; None elsewhere, and where it
    #: could not be read.
    uss_bytes: Optional[int] = None
    pss_bytes: Optional[int] = None

    @cached_property  # asked several times a poll: once per record (evolve's copies anew)
    def holds_gpu(self) -> bool:
        return bool(self.gpu_usage)

    @property
    def gpu_memory_bytes(self) -> Optional[int]:
        """Total GPU memory over all devices; None when any figure is unknown: the sum of the
        rest would read as the whole (and as a drop, in a leak's history)."""
        total = 0
        for u in self.gpu_usage:
            if u.memory_bytes is None:
                return None
            total += u.memory_bytes
        return total

    @cached_property
    def identity(self) -> tuple[int, Optional[float]]:
        return (self.pid, self.start_time)

    @property
    def waits_in_gpu_driver(self) -> bool:
        """Its wait channel or kernel stack names the NVIDIA driver (nvidia.ko, nvidia-uvm)."""
        return any(mark in frame.lower() for frame in (self.wchan or "", *self.kernel_stack)
                   for mark in _GPU_DRIVER_MARKS)


#: What names the NVIDIA kernel modules in a wait channel or a stack frame: their module names
#: (`[nvidia]`, `[nvidia_uvm]`), nvidia.ko's `nvidia_*` symbols and nvidia-uvm's `uvm_*`.
_GPU_DRIVER_MARKS = ("nvidia", "uvm_")


def holds_gpu(p: HostProcess, blind: Collection[int]) -> Optional[bool]:
    """Whether NVML lists `p`, `blind` being the GPUs whose holders are unknown in this poll
    (`NodeSnapshot.blind_gpus`): None (unknown) when every GPU it was seen on is blind and it
    is there only as a holder of the last good read, with an unknown figure."""
    if not p.gpu_usage:
        return False
    if all(u.gpu_index in blind and u.memory_bytes is None for u in p.gpu_usage):
        return None
    return True


def gpu_memory(p: HostProcess, blind: Collection[int]) -> Optional[int]:
    """`p`'s GPU memory in all; None when part of it is unknown, or on a GPU of `blind` (whose
    holders are unknown): a sum of the rest would read as the whole."""
    if any(u.gpu_index in blind and u.memory_bytes is None for u in p.gpu_usage):
        return None
    return p.gpu_memory_bytes


@_frozen
class BufferSize:
    # Slotted: the agent receiver stores one per buffer per report.
    __slots__ = ("bytes", "items")
    items: Optional[int]
    bytes: Optional[int]


@_frozen
class DiscoveredSize(BufferSize):
    """A discovered container's size, and the training step the agent counted it at (a pass
    spans steps; None: the step of the report that carries it)."""
    __slots__ = ("step",)
    step: Optional[int]


#: `StepPoint.discovered` of a report that carried no discovery pass. A pass that found nothing
#: growing gives a different, empty mapping: it says that what earlier passes named stopped.
NO_DISCOVERY: Mapping[str, BufferSize] = MappingProxyType({})


class StepPoint(NamedTuple):
    """One agent step report, as the daemon received it.

    A named tuple, not a frozen dataclass like its neighbours: the receiver builds one per report
    at tens of thousands a second, and a tuple is built in half the time a frozen dataclass's
    __init__ takes (one object.__setattr__ call per field), with the same immutability.
    """

    step: int
    #: Receive time on the daemon's clock, not the agent's.
    at: float
    rss_bytes: Optional[int]
    cuda_allocated_bytes: Optional[int]
    cuda_reserved_bytes: Optional[int]
    buffers: Mapping[str, BufferSize]
    #: torch's "active_bytes.all.current" and "allocation.all.current".
    cuda_active_bytes: Optional[int] = None
    cuda_allocations: Optional[int] = None
    #: Growing containers the agent found by itself, by qualified name; NO_DISCOVERY when the
    #: report followed no discovery pass.
    discovered: Mapping[str, BufferSize] = NO_DISCOVERY
    #: A `tick` report: a process that has not stepped, reporting on a timer. Its `step` means
    #: nothing (0); its figures are by the time received (`at`).
    ticked: bool = False


@_frozen
class TraceSite:
    """One allocation site of a trace: net growth over the traced steps."""

    #: Relative to the longest sys.path entry containing it, else absolute.
    file: str
    line: int
    bytes: int
    #: Net blocks allocated there.
    count: int


@_frozen
class TraceReport:
    """An agent's answer to a trace request (docs/agent-protocol.md)."""

    #: Done, refused or failed (never requested: that is the daemon's, while it waits).
    status: TraceStatus
    #: Why it was refused or failed ("GPUWATCH_AGENT_TRACING=0", "busy"); empty when done.
    why: str
    #: Steps actually traced (done only).
    steps: Optional[int]
    #: Largest growth first.
    sites: tuple[TraceSite, ...]
    #: (file, line) frames of the top site's allocation, oldest call first.
    traceback: tuple[tuple[str, int], ...]
    #: Receive time on the daemon's clock.
    received_at: float
    #: The training step the agent had reached when it answered.
    step: Optional[int]


@_frozen
class AgentReading:
    """What one instrumented process has reported (docs/agent-protocol.md).

    `pid` and `uid` come from the kernel, never from the payload.
    """

    pid: int
    uid: int
    first_seen: float
    last_seen: float
    step: Optional[int]
    #: When `step` last changed: a stall is a step that stops changing.
    step_changed_at: Optional[float]
    finished_at: Optional[float]
    exit_report: Optional[Mapping[str, Any]]
    #: Step reports since the previous poll, oldest first.
    points: tuple[StepPoint, ...]
    latest: Optional[StepPoint]
    #: The newest answer to a trace request.
    trace: Optional[TraceReport] = None
    #: Whether the daemon can send this process requests: it reports from an abstract address.
    can_reply: bool = False


FindingIdentity = tuple[str, Optional[int], Optional[float], tuple[int, ...]]


@_frozen
class Finding:
    """Something wrong on the node, with the evidence for it.

    `pid` with `start_time` names the process, so a finding never carries over to a process that
    reuses the PID. `reason` is stable while the finding stays open; `since` says when it was
    first seen; `job` is the process's job, or the job of the tree it was first seen in.

    `summary` says the same as `reason` from identity and figures only: PIDs, kernel names
    (`comm`), clock times, sizes and counts, and gpuwatch's own words for the kind of evidence.
    Never a command line, an environment value, a path or a name a program chose (a buffer's, a
    thread's): it is what /metrics serves (`gpuwatch_finding_info`, docs/security.md rule 5).
    It is kept and refined with the reason.
    """

    kind: Kind
    severity: Severity
    #: The evidence in words, as first given: it stays the same while the finding is open.
    reason: str
    pid: Optional[int] = None  # None for device-level findings (unattributed GPU memory)
    start_time: Optional[float] = None
    name: Optional[str] = None
    user: Optional[str] = None
    job: Optional[Job] = None
    gpus: tuple[int, ...] = ()
    gpu_memory_bytes: Optional[int] = None
    since: float = 0.0
    #: Figures that go with the finding (a leak's growth and projected OOM), kept out of the
    #: reason so that it stays the same while the figures move (gpuwatch.evidence); None where
    #: the reason says it all.
    details: Optional[Details] = None
    #: The evidence in words a local scraper may read: identity and figures only (see above).
    summary: str = ""

    @property
    def identity(self) -> FindingIdentity:
        return Finding.identity_of(self.kind, self.pid, self.start_time, self.gpus)

    @staticmethod
    def identity_of(kind: Kind, pid: Optional[int], start_time: Optional[float],
                    gpus: tuple[int, ...] = ()) -> FindingIdentity:
        """What tells one finding from another across polls: its kind and process, or for a
        finding of no process (a ghost), its GPUs."""
        return (kind, pid, start_time, gpus if pid is None else ())


@_frozen
class ProcessReading:
    """What the host-process source produced in one poll."""

    processes: Mapping[int, HostProcess]
    errors: tuple[SourceError, ...] = ()
    #: NodeSnapshot.gone_group_leaders, for the GPU holders this reading read.
    gone_group_leaders: frozenset[int] = frozenset()


@_frozen
class NodeSnapshot:
    """One poll of the node: NVML's view, the processes that matter, and their context."""

    #: When it was taken, on the daemon's steady clock (gpuwatch.clock), as every time in it is.
    taken_at: float
    hostname: str
    nvml: NvmlStatus
    gpus: tuple[GpuDevice, ...]
    #: GPU holders, their ancestors up to PID 1, and (without NVML) processes that look like GPU
    #: workers; keyed by PID.
    processes: Mapping[int, HostProcess]
    errors: tuple[SourceError, ...] = ()
    poll_duration_seconds: float = 0.0
    #: The launcher each process's job tree hangs from (see gpuwatch.jobs.tree), by PID.
    job_roots: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))
    #: Instrumented processes (gpuwatch.agent), by PID.
    agents: Mapping[int, AgentReading] = field(default_factory=lambda: MappingProxyType({}))
    #: The node's MemAvailable, the last resort limit for host memory growth.
    mem_available_bytes: Optional[int] = None
    #: cgroup path -> (memory.max or None when unlimited, memory.current), where readable.
    cgroup_memory: Mapping[str, tuple[Optional[int], int]] = field(
        default_factory=lambda: MappingProxyType({}))
    #: Each PID a process names as its `gpuwatch run` supervisor (GPUWATCH_RUN_SUPERVISOR): the
    #: start time of the process running on that PID now, None when none runs there (no such
    #: PID, or a zombie). A PID that could not be read is absent: nobody knows.
    run_supervisors: Mapping[int, Optional[float]] = field(
        default_factory=lambda: MappingProxyType({}))
    #: Processes asked to trace their allocations that have not answered yet: PID -> the steps
    #: asked for (gpuwatch.actions.trace_requests).
    traces_pending: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))
    #: How far the wall clock had stepped from the steady clock when this was taken (an NTP
    #: step, a VM resumed): 0 until somebody sets the clock.
    clock_step: float = 0.0
    #: The PID, as this /proc shows it, of the process that took the snapshot (the daemon, a
    #: one-shot `status`): never a job's member to report, whatever tree it sits in.
    observer_pid: Optional[int] = None
    #: The Kubernetes pods of the processes here, by pod UID (gpuwatch.sources.pods): their
    #: names, the GPUs the kubelet allocated them, and whether the kubelet still lists them.
    pods: Mapping[str, Pod] = field(default_factory=lambda: MappingProxyType({}))
    #: The process groups (PGIDs) of GPU holders whose leader, another process, has exited (no
    #: such PID, or a zombie). A group outlives its leader, so this shows that a launcher which
    #: led its workers' group is gone, without any history. A fact about the leader, kept here
    #: rather than on each holder's record: a record holds what /proc says of its own process,
    #: and stays the same object from poll to poll while that does not change.
    gone_group_leaders: frozenset[int] = frozenset()

    def wall(self, t: float) -> float:
        """A time of this snapshot's (`taken_at`, a start time, a `since`) on the wall clock:
        what sinks show. Detectors compare times as they are."""
        return t + self.clock_step

    def wall_or_none(self, t: Optional[float]) -> Optional[float]:
        return self.wall(t) if t is not None else None

    @property
    def blind_gpus(self) -> frozenset[int]:
        """The GPUs whose holders are unknown in this poll (`holders_unknown`)."""
        return frozenset(g.index for g in self.gpus if g.holders_unknown)

    @property
    def gpu_holders(self) -> list[HostProcess]:
        return [p for p in self.processes.values() if p.holds_gpu]


@_frozen
class NodeReport:
    """A snapshot and the findings over it: what the sinks serve."""

    snapshot: NodeSnapshot
    findings: tuple[Finding, ...] = ()
    #: Each process's job by PID: its own (cgroup, environment), else the job of the tree it was
    #: first seen in (a launcher or a helper carries no job variables of its own).
    jobs: Mapping[int, Job] = field(default_factory=lambda: MappingProxyType({}))
    #: Where it was made: "poll" (a poll of the command's own) or "daemon" (a running daemon's
    #: view, with history); and, for a poll, why not the daemon's. A report read back from a
    #: status document (gpuwatch.sinks.document.from_json) says what the document said.
    source: str = "poll"
    source_detail: Optional[str] = None

    def job_of(self, p: HostProcess) -> Optional[Job]:
        return self.jobs.get(p.pid, p.job)
