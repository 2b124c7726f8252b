"""The status document: the versioned JSON shape of a snapshot (and later its findings).

`gpuwatch status --json` prints it, the daemon's state socket serves it and the table view renders
it, so there is one serialisation and scripts see exactly what people see. docs/json.md describes
every field; bump SCHEMA_VERSION on any incompatible change.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Collection, Mapping
from types import MappingProxyType
from typing import Any, Optional

from gpuwatch import __version__
from gpuwatch.document_types import (
    AgentDoc,
    ExecutableDoc,
    FindingDoc,
    GpuDoc,
    GpuUsageDoc,
    JobDoc,
    ProcessDoc,
    StatusDocument,
)
from gpuwatch.model import (
    AgentReading,
    BufferSize,
    Executable,
    Finding,
    GpuDevice,
    GpuProcessUsage,
    HostProcess,
    Job,
    Kind,
    NodeReport,
    NodeSnapshot,
    NvmlCallError,
    NvmlStatus,
    SourceError,
    StepPoint,
    gpu_memory,
    holds_gpu,
)
from gpuwatch.sinks.details_doc import details_doc, details_of
from gpuwatch.vocabulary import ProcState, Severity

SCHEMA_VERSION = 1

#: Where the document came from: a running daemon's view (with history) or one poll of our own.
SOURCE_DAEMON = "daemon"
SOURCE_POLL = "poll"

#: The most the daemon serves of a document, in bytes of JSON (docs/security.md, "Bytes, not
#: entries"). A document over it is made to fit (bounded_json): its texts shortened first, then
#: the processes that matter least left out, and it says so.
MAX_DOCUMENT_BYTES = 8 << 20
#: What a process's command line, cgroup path and each launch variable keep of themselves in a
#: document made to fit, in characters.
_SHORT_TEXT = 256
#: Ends a text shortened to fit the document.
DOCUMENT_CUT = "…[cut to fit the document]"


def status_document(report: NodeReport, source: Optional[str] = None,
                    source_detail: Optional[str] = None, *, with_processes: bool = True
                    ) -> StatusDocument:
    """The document of `report`; `source` and `source_detail` default to the report's.
    Without `with_processes`, its processes are an empty list (DocumentWriter writes them)."""
    if source is None:
        source, source_detail = report.source, report.source_detail
    snapshot = report.snapshot
    nvml = snapshot.nvml
    blind = snapshot.blind_gpus
    # Every time on the wall clock (NodeSnapshot.wall), as a process reading /proc now sees it.
    wall = snapshot.wall
    return {
        "schema": SCHEMA_VERSION,
        "gpuwatch_version": __version__,
        "source": source,
        "source_detail": source_detail,
        "node": snapshot.hostname,
        "taken_at": round(wall(snapshot.taken_at), 3),
        "poll_duration_seconds": round(snapshot.poll_duration_seconds, 6),
        "nvml": {
            "available": nvml.available,
            "error": nvml.error,
            "error_code": nvml.error_code,
            "driver_version": nvml.driver_version,
            "nvml_version": nvml.nvml_version,
            "cuda_driver_version": nvml.cuda_driver_version,
            "device_count": nvml.device_count,
        },
        "gpus": [_gpu(g) for g in snapshot.gpus],
        "processes": [_process(p, report.job_of(p), snapshot.job_roots.get(p.pid),
                               snapshot.agents.get(p.pid), blind, wall)
                      for p in sorted(snapshot.processes.values(), key=lambda p: p.pid)]
        if with_processes else [],
        "findings": [_finding(f, wall) for f in report.findings],
        "errors": [{"source": e.source, "message": e.message} for e in snapshot.errors],
    }


def _gpu(g: GpuDevice) -> GpuDoc:
    return {
        "index": g.index,
        "uuid": g.uuid,
        "name": g.name,
        "pci_bus_id": g.pci_bus_id,
        "memory_total_bytes": g.memory_total_bytes,
        "memory_used_bytes": g.memory_used_bytes,
        "memory_free_bytes": g.memory_free_bytes,
        "memory_reserved_bytes": g.memory_reserved_bytes,
        "unattributed_memory_bytes": g.unattributed_memory_bytes,
        "utilization_gpu_percent": g.utilization_gpu_percent,
        "utilization_memory_percent": g.utilization_memory_percent,
        "mig_enabled": g.mig_enabled,
        "process_count": len(g.processes),
        "holders_unknown": g.holders_unknown,
        "lost": g.lost,
        "errors": [{"call": e.call, "code": e.code, "message": e.message} for e in g.errors],
    }


def _usage(u: GpuProcessUsage) -> GpuUsageDoc:
    return GpuUsageDoc(index=u.gpu_index, uuid=u.gpu_uuid, memory_bytes=u.memory_bytes,
                       type=u.kind, gpu_instance_id=u.gpu_instance_id,
                       compute_instance_id=u.compute_instance_id)


def _finding(f: Finding, wall: Callable[[float], float]) -> FindingDoc:
    return {
        "kind": f.kind,
        "severity": f.severity,
        "pid": f.pid,
        "start_time": _at(f.start_time, wall, 2),
        "name": f.name,
        "user": f.user,
        "job": _job(f.job),
        "gpus": list(f.gpus),
        "gpu_memory_bytes": f.gpu_memory_bytes,
        "reason": f.reason,
        "summary": f.summary,
        "since": round(wall(f.since), 3),
        "details": details_doc(f.details),
    }


def _plain(value: Any) -> Any:
    """`value` as JSON types: an agent's exit report may nest read-only mappings and tuples,
    which json cannot write as they are."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _at(t: Optional[float], wall: Callable[[float], float], digits: int = 3
        ) -> Optional[float]:
    return round(wall(t), digits) if t is not None else None


def _agent(a: Optional[AgentReading], wall: Callable[[float], float]
           ) -> Optional[AgentDoc]:
    if a is None:
        return None
    latest = a.latest
    return {
        "step": a.step,
        "step_changed_at": _at(a.step_changed_at, wall),
        "first_seen": _at(a.first_seen, wall),
        "last_seen": _at(a.last_seen, wall),
        "finished_at": _at(a.finished_at, wall),
        "rss_bytes": latest.rss_bytes if latest else None,
        "cuda_allocated_bytes": latest.cuda_allocated_bytes if latest else None,
        "cuda_reserved_bytes": latest.cuda_reserved_bytes if latest else None,
        # Read with defaults: a step point from before these figures existed has none.
        "cuda_active_bytes": getattr(latest, "cuda_active_bytes", None),
        "cuda_allocations": getattr(latest, "cuda_allocations", None),
        "buffers": {name: {"items": b.items, "bytes": b.bytes}
                    for name, b in (latest.buffers.items() if latest else ())},
        "exit": _plain(a.exit_report) if a.exit_report is not None else None,
    }


def _job(job: Optional[Job]) -> Optional[JobDoc]:
    if job is None:
        return None
    doc: JobDoc = {"id": job.id, "source": job.source}
    if job.namespace and job.pod:
        doc["namespace"] = job.namespace
        doc["pod"] = job.pod
        doc["container"] = job.container
    return doc


def _process(p: HostProcess, job: Optional[Job], job_root: Optional[int],
             agent: Optional[AgentReading], blind: Collection[int],
             wall: Callable[[float], float]) -> ProcessDoc:
    return {
        "pid": p.pid,
        "ppid": p.ppid,
        "pgid": p.pgid,
        "sid": p.sid,
        "job_root": job_root,
        # Two decimals, as /proc's clock ticks give it: compared for a process's identity.
        "start_time": _at(p.start_time, wall, 2),
        "name": p.name,
        "user": p.user,
        "uid": p.uid,
        "state": p.state,
        "rss_bytes": p.rss_bytes,
        "uss_bytes": p.uss_bytes,
        "pss_bytes": p.pss_bytes,
        "num_threads": p.num_threads,
        "gpu_memory_bytes": gpu_memory(p, blind),
        "gpus": [_usage(u) for u in p.gpu_usage],
        "holds_gpu": holds_gpu(p, blind),
        "job": _job(job),
        "cgroup": p.cgroup,
        "system_unit": p.system_unit,
        "exe": _exe(p.exe),
        "launch_env": dict(p.launch_env),
        "cmdline": list(p.cmdline),
        "in_procfs": p.in_procfs,
        "read_errors": list(p.read_errors),
        "wchan": p.wchan,
        "kernel_stack": list(p.kernel_stack),
        "agent": _agent(agent, wall),
    }


def bounded_json(doc: StatusDocument, limit: int = MAX_DOCUMENT_BYTES
                 ) -> tuple[bytes, Optional[str]]:
    """`doc` as JSON of at most `limit` bytes, and what was cut to fit it (None: nothing).

    Texts are cut at the read already (a command line to 4 KiB), so only a node of thousands of
    processes with long texts each comes near the limit. Then each process's command line, cgroup
    path and launch variables are shortened to _SHORT_TEXT characters; if that is not enough,
    processes that neither hold GPU memory nor are named by a finding are left out, shared by
    user: the largest of the user whose such processes weigh most, first. What was cut is said
    in `source_detail` and as an error of source "document", so both `status` and a script
    reading the JSON see it.
    """
    body = json.dumps(doc).encode()
    if len(body) <= limit:
        return body, None
    processes = [_shortened(p) for p in doc["processes"]]
    cut = f"document over {limit >> 20} MiB: texts shortened"
    body = _json_with(doc, processes, cut)
    if len(body) > limit:
        named = {f["pid"] for f in doc["findings"]}
        droppable: dict[Optional[int], list[tuple[int, int]]] = {}
        for i, p in enumerate(processes):
            if not p["holds_gpu"] and p["pid"] not in named:
                droppable.setdefault(p["uid"], []).append((len(json.dumps(p)), i))
        over = len(body) - limit + 4096  # room for the note saying so
        dropped = _dropped_by_user(droppable, over)
        processes = [p for i, p in enumerate(processes) if i not in dropped]
        cut += f", {len(dropped)} processes left out"
        body = _json_with(doc, processes, cut)
    return body, cut


class DocumentWriter:
    """Writes a report's status document as bounded_json would, keeping the JSON of each
    process's part from one document to the next while nothing in it changes.

    Most of a node's processes show the same figures from one poll to the next, and their part
    is most of the document (1,024 processes: 0.8 MB): a document after a poll serialises
    again only the processes whose record, job, agent reading or wall-clock times changed.
    The body is byte for byte `bounded_json(status_document(report, ...))`; one over the
    limit is made to fit by bounded_json itself. Not for several threads at once: the daemon
    writes its document under a lock."""

    def __init__(self, limit: int = MAX_DOCUMENT_BYTES) -> None:
        self.limit = limit
        self._parts: dict[int, tuple[tuple[Any, ...], str]] = {}
        #: Process parts serialised / kept from the last document (for tests and benches).
        self.written = 0
        self.kept = 0

    def json(self, report: NodeReport, source: Optional[str] = None,
             source_detail: Optional[str] = None) -> tuple[bytes, Optional[str]]:
        """bounded_json(status_document(report, source, source_detail))."""
        doc = status_document(report, source, source_detail, with_processes=False)
        snapshot = report.snapshot
        blind, wall = snapshot.blind_gpus, snapshot.wall
        old, new = self._parts, {}
        parts = []
        encode = _ENCODER.encode
        for p in sorted(snapshot.processes.values(), key=lambda p: p.pid):
            job, root, agent = report.job_of(p), snapshot.job_roots.get(p.pid), \
                snapshot.agents.get(p.pid)
            # Everything the part is made of: the record, its job, root and agent reading,
            # the GPUs whose holders are unknown, and its times on the wall clock (an agent's
            # several, else the start time alone).
            times = snapshot.clock_step if agent is not None else _at(p.start_time, wall, 2)
            key = (p, job, root, agent, blind, times)
            entry = old.get(p.pid)
            if entry is None or entry[0] != key:
                entry = (key, encode(_process(p, job, root, agent, blind, wall)))
                self.written += 1
            else:
                self.kept += 1
            new[p.pid] = entry
            parts.append(entry[1])
        self._parts = new
        fields = [f"{encode(k)}: {encode(v)}" if k != "processes"
                  else f'"processes": [{", ".join(parts)}]' for k, v in doc.items()]
        body = ("{" + ", ".join(fields) + "}").encode()
        if len(body) <= self.limit:
            return body, None
        return bounded_json(status_document(report, source, source_detail), self.limit)


#: json.dumps's own encoder (its defaults), for the parts of a document.
_ENCODER = json.JSONEncoder()


def _dropped_by_user(droppable: dict[Optional[int], list[tuple[int, int]]], over: int
                     ) -> set[int]:
    """Which processes to leave out (indexes) to save `over` bytes: always the largest of the
    user whose droppable processes weigh most then, so one user's thousands of processes are
    left out before another user's few, however long the few's texts."""
    heap: list[tuple[int, int, Optional[int]]] = []
    for order, (uid, entries) in enumerate(droppable.items()):
        entries.sort()  # the largest last
        heapq.heappush(heap, (-sum(size for size, _ in entries), order, uid))
    dropped: set[int] = set()
    while over > 0 and heap:
        total, order, uid = heapq.heappop(heap)
        size, i = droppable[uid].pop()
        dropped.add(i)
        over -= size + 2
        if droppable[uid]:
            heapq.heappush(heap, (total + size, order, uid))
    return dropped


def _json_with(doc: StatusDocument, processes: list[ProcessDoc], cut: str) -> bytes:
    detail = f"{doc['source_detail']}; {cut}" if doc["source_detail"] else cut
    return json.dumps({**doc, "source_detail": detail, "processes": processes,
                       "errors": [*doc["errors"], {"source": "document", "message": cut}]}
                      ).encode()


def _shortened(p: ProcessDoc) -> ProcessDoc:
    short: ProcessDoc = {**p}
    short["cmdline"] = _short_args(p["cmdline"])
    if p["cgroup"] is not None and len(p["cgroup"]) > _SHORT_TEXT:
        short["cgroup"] = p["cgroup"][:_SHORT_TEXT] + DOCUMENT_CUT
    short["launch_env"] = {k: v if len(v) <= _SHORT_TEXT else v[:_SHORT_TEXT] + DOCUMENT_CUT
                           for k, v in p["launch_env"].items()}
    exe = p["exe"]
    # A path a user chose (not root's: nothing is protected by it) is cut as their texts are.
    if exe is not None and not exe["root_controlled"] and len(exe["path"]) > _SHORT_TEXT:
        short["exe"] = {**exe, "path": exe["path"][:_SHORT_TEXT] + DOCUMENT_CUT}
    return short


def _short_args(args: list[str]) -> list[str]:
    """The arguments that fit in _SHORT_TEXT characters, then DOCUMENT_CUT if any did not."""
    kept: list[str] = []
    room = _SHORT_TEXT
    for arg in args:
        if len(arg) > room:
            if room > 0:
                kept.append(arg[:room])
            return [*kept, DOCUMENT_CUT]
        kept.append(arg)
        room -= len(arg) + 1
    return kept


def _exe(exe: Optional[Executable]) -> Optional[ExecutableDoc]:
    if exe is None:
        return None
    return {"path": exe.path, "owner_uid": exe.owner_uid, "root_controlled": exe.root_controlled}


# -- reading a document back -------------------------------------------------------------------
def from_json(doc: StatusDocument) -> NodeReport:
    """The report a status document was rendered from, as far as it tells: what the command
    line reads from the daemon's state socket, read once here so that the reaper, `top` and
    the views work on the model's types. Every time in it is already on the wall clock (its
    clock step is 0), and `status_document(from_json(doc)) == doc`
    (tests/test_status.py checks). An agent's reading keeps what the document shows of it: its
    step, times and latest figures, none of its step history."""
    usages = {p["pid"]: tuple(_usage_of(p["pid"], u) for u in p["gpus"])
              for p in doc["processes"]}
    processes = {p["pid"]: _process_of(p, usages[p["pid"]]) for p in doc["processes"]}
    on_gpu: dict[int, list[GpuProcessUsage]] = {}
    for pid in sorted(usages):
        for u in usages[pid]:
            on_gpu.setdefault(u.gpu_index, []).append(u)
    nvml = doc["nvml"]
    snapshot = NodeSnapshot(
        taken_at=doc["taken_at"], hostname=doc["node"],
        nvml=NvmlStatus(available=nvml["available"], error=nvml["error"],
                        error_code=nvml["error_code"], driver_version=nvml["driver_version"],
                        nvml_version=nvml["nvml_version"],
                        cuda_driver_version=nvml["cuda_driver_version"],
                        device_count=nvml["device_count"]),
        gpus=tuple(_gpu_of(g, tuple(on_gpu.get(g["index"], ()))) for g in doc["gpus"]),
        processes=MappingProxyType(processes),
        errors=tuple(SourceError(e["source"], e["message"]) for e in doc["errors"]),
        poll_duration_seconds=doc["poll_duration_seconds"],
        job_roots=MappingProxyType({p["pid"]: p["job_root"] for p in doc["processes"]
                                    if p["job_root"] is not None}),
        agents=MappingProxyType({p["pid"]: _agent_of(p["pid"], p["uid"], a)
                                 for p in doc["processes"] if (a := p["agent"]) is not None}))
    return NodeReport(
        snapshot, tuple(_finding_of(f) for f in doc["findings"]),
        MappingProxyType({pid: p.job for pid, p in processes.items() if p.job is not None}),
        source=doc["source"], source_detail=doc["source_detail"])


def _job_of(job: Optional[JobDoc]) -> Optional[Job]:
    if job is None:
        return None
    return Job(job["id"], job["source"], namespace=job.get("namespace"), pod=job.get("pod"),
               container=job.get("container"))


def _usage_of(pid: int, u: GpuUsageDoc) -> GpuProcessUsage:
    return GpuProcessUsage(gpu_index=u["index"], gpu_uuid=u["uuid"], pid=pid,
                           memory_bytes=u["memory_bytes"], kinds=frozenset(u["type"].split("+")),
                           gpu_instance_id=u["gpu_instance_id"],
                           compute_instance_id=u["compute_instance_id"])


def _gpu_of(g: GpuDoc, processes: tuple[GpuProcessUsage, ...]) -> GpuDevice:
    return GpuDevice(
        index=g["index"], uuid=g["uuid"], name=g["name"], pci_bus_id=g["pci_bus_id"],
        memory_total_bytes=g["memory_total_bytes"], memory_used_bytes=g["memory_used_bytes"],
        memory_free_bytes=g["memory_free_bytes"],
        memory_reserved_bytes=g["memory_reserved_bytes"],
        utilization_gpu_percent=g["utilization_gpu_percent"],
        utilization_memory_percent=g["utilization_memory_percent"],
        mig_enabled=g["mig_enabled"], processes=processes,
        errors=tuple(NvmlCallError(e["call"], e["code"] if e["code"] is not None else -1,
                                   e["message"]) for e in g["errors"]),
        lost=g["lost"])


def _process_of(p: ProcessDoc, usage: tuple[GpuProcessUsage, ...]) -> HostProcess:
    return HostProcess(
        pid=p["pid"], in_procfs=p["in_procfs"], ppid=p["ppid"], pgid=p["pgid"], sid=p["sid"],
        start_time=p["start_time"], name=p["name"], cmdline=tuple(p["cmdline"]),
        user=p["user"], uid=p["uid"], state=ProcState.parse(p["state"]),
        rss_bytes=p["rss_bytes"],
        num_threads=p["num_threads"], cgroup=p["cgroup"],
        # .get: a daemon of an earlier version does not say; nothing is protected by them then.
        system_unit=p.get("system_unit"), exe=_exe_of(p.get("exe")), job=_job_of(p["job"]),
        launch_env=MappingProxyType(dict(p["launch_env"])), gpu_usage=usage,
        read_errors=tuple(p["read_errors"]), wchan=p["wchan"],
        kernel_stack=tuple(p["kernel_stack"]),
        # (Absent from documents written before they were read.)
        uss_bytes=p.get("uss_bytes"), pss_bytes=p.get("pss_bytes"))


def _exe_of(exe: Optional[ExecutableDoc]) -> Optional[Executable]:
    if not isinstance(exe, dict):
        return None
    return Executable(path=str(exe["path"]), owner_uid=int(exe["owner_uid"]),
                      root_controlled=exe["root_controlled"] is True)


def _agent_of(pid: int, uid: Optional[int], a: AgentDoc) -> AgentReading:
    figures = (a["rss_bytes"], a["cuda_allocated_bytes"], a["cuda_reserved_bytes"],
               a["cuda_active_bytes"], a["cuda_allocations"])
    latest = None
    if a["buffers"] or any(x is not None for x in figures):
        latest = StepPoint(
            step=a["step"] or 0, at=a["last_seen"] or 0.0, rss_bytes=a["rss_bytes"],
            cuda_allocated_bytes=a["cuda_allocated_bytes"],
            cuda_reserved_bytes=a["cuda_reserved_bytes"],
            buffers=MappingProxyType({name: BufferSize(items=b["items"], bytes=b["bytes"])
                                      for name, b in a["buffers"].items()}),
            cuda_active_bytes=a["cuda_active_bytes"], cuda_allocations=a["cuda_allocations"])
    return AgentReading(
        pid=pid, uid=uid if uid is not None else -1, first_seen=a["first_seen"] or 0.0,
        last_seen=a["last_seen"] or 0.0, step=a["step"], step_changed_at=a["step_changed_at"],
        finished_at=a["finished_at"],
        exit_report=MappingProxyType(dict(a["exit"])) if a["exit"] is not None else None,
        points=(), latest=latest)


def _finding_of(f: FindingDoc) -> Finding:
    return Finding(kind=Kind(f["kind"]), severity=Severity(f["severity"]), reason=f["reason"],
                   pid=f["pid"], start_time=f["start_time"], name=f["name"], user=f["user"],
                   job=_job_of(f["job"]), gpus=tuple(f["gpus"]),
                   gpu_memory_bytes=f["gpu_memory_bytes"], since=f["since"],
                   details=details_of(f["details"]),
                   # A document from before the summary: it is unknown, not made up.
                   summary=f.get("summary", ""))
