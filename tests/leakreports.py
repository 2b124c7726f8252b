"""Node reports with leak findings as the leak detector gives them, for the sinks' tests: one
process per way a culprit is found (watched, discovered, traced), one whose trace was refused,
and the figures an instrumented process reports."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Optional

from gpuwatch.evidence import LeakEvidence
from gpuwatch.model import (
    AgentReading,
    BufferSize,
    Finding,
    GpuProcessUsage,
    HostProcess,
    Job,
    Kind,
    NodeReport,
    NodeSnapshot,
    NvmlStatus,
    StepPoint,
)
from gpuwatch.sinks.details_doc import details_of
from gpuwatch.vocabulary import GrowthUnit, Severity

GIB = 1 << 30
MIB = 1 << 20
TAKEN_AT = 1_700_000_000.0
JOB = Job("61", "slurm")

#: A culprit longer than a label value may be: a traced file deep in a virtualenv.
LONG_SITE = ("/opt/conda/envs/train/lib/python3.11/site-packages/" + "deeply/nested/" * 8
             + "areal/infra/rpc/rtensor.py:1234")


def leak(pid: int, reason: str, **details: Any) -> Finding:
    """A leak finding whose evidence reads as the document's `details` object given."""
    base: dict[str, Any] = {"series": "RSS", "unit": "step", "window_steps": [10, 74]}
    if details.get("unit") == "second":
        del base["window_steps"]
    evidence = details_of({**base, **details})
    assert isinstance(evidence, LeakEvidence)
    return Finding(Kind.LEAK, Severity.WARNING, reason, pid=pid, start_time=TAKEN_AT - 600,
                   name="python3", user="gina", job=JOB, gpus=(0,), gpu_memory_bytes=4 * GIB,
                   since=TAKEN_AT - 60, details=evidence)


WATCHED = leak(700, "RSS grows every step; buffer `fetch_buffer` explains it (watched); runs out "
               "against the cgroup limit", growth_bytes_per_step=2 * MIB, culprit="fetch_buffer",
               found_by="watched", culprit_bytes_per_step=2 * MIB, culprit_items_per_step=1.0,
               limit_source="cgroup", limit_bytes=64 * GIB, available_bytes=GIB,
               projected_oom_step=586, projected_oom_in_seconds=5400)
DISCOVERED = leak(701, "RSS grows every step; `areal.infra.rpc.rtensor._fetch_buffer` explains "
                  "it (discovered)", growth_bytes_per_step=2 * GIB + 12345,
                  culprit="areal.infra.rpc.rtensor._fetch_buffer", found_by="discovered",
                  culprit_bytes_per_step=2 * GIB, culprit_items_per_step=16.0)
TRACED = leak(702, "RSS grows every step; allocations at `leaky.py:42` explain it (traced)",
              growth_bytes_per_step=3 * MIB, culprit="leaky.py:42", found_by="traced",
              culprit_bytes_per_step=3 * MIB,
              trace=MappingProxyType({
                  "status": "done", "why": "", "steps": 20,
                  "sites": ({"site": "leaky.py:42", "bytes_per_step": 3 * MIB,
                             "count_per_step": 1.0},
                            {"site": "data/loader.py:88", "bytes_per_step": 4096,
                             "count_per_step": 0.5}),
                  "traceback": ("train.py:120", "model/step.py:57", "leaky.py:42")}))
REFUSED = leak(703, "RSS grows every step", growth_bytes_per_step=MIB, culprit=None,
               found_by=None, trace={"status": "refused", "why": "GPUWATCH_AGENT_TRACING=0"})
LONG = leak(704, "RSS grows every step; allocations at `...` explain it (traced)",
            growth_bytes_per_step=MIB, culprit=LONG_SITE, found_by="traced",
            culprit_bytes_per_step=MIB)
#: A GPU-memory leak nothing explains, its details as a daemon gave them before `found_by`.
PLAIN = leak(705, "GPU memory grows every step", series="GPU memory",
             growth_bytes_per_step=64 * MIB, culprit=None)

#: A process without the agent: growth per second, nothing to name a culprit with.
NO_AGENT = leak(706, "RSS grows steadily (no agent); runs out against the node limit",
                unit="second", growth_bytes_per_second=MIB, limit_source="node",
                limit_bytes=None, available_bytes=8 * GIB, projected_oom_in_seconds=8192,
                projected_oom_at=round(TAKEN_AT) + 8192)

LEAKS = (WATCHED, DISCOVERED, TRACED, REFUSED, LONG, PLAIN, NO_AGENT)
#: The leaks of instrumented processes: those measured by the step.
BY_STEP = LEAKS[:-1]


def process(pid: int) -> HostProcess:
    return HostProcess(pid=pid, ppid=1, start_time=TAKEN_AT - 600, name="python3",
                       cmdline=("python3", "train.py"), user="gina", uid=1000, state="running",
                       rss_bytes=6 * GIB, job=JOB,
                       gpu_usage=(GpuProcessUsage(0, "GPU-0", pid, 4 * GIB),))


def agent(pid: int, cuda: Optional[Mapping[str, int]] = None) -> AgentReading:
    cuda = cuda or {}
    point = StepPoint(74, TAKEN_AT - 1, 6 * GIB, cuda.get("allocated"), cuda.get("reserved"),
                      MappingProxyType({"fetch_buffer": BufferSize(74, 148 * MIB)}),
                      cuda_active_bytes=cuda.get("active"),
                      cuda_allocations=cuda.get("allocations"))
    return AgentReading(pid=pid, uid=1000, first_seen=TAKEN_AT - 500, last_seen=TAKEN_AT - 1,
                        step=74, step_changed_at=TAKEN_AT - 1, finished_at=None,
                        exit_report=None, points=(point,), latest=point)


#: The figures of PyTorch's caching allocator for process 700.
CUDA = {"allocated": 3 * GIB, "reserved": 5 * GIB, "active": 3 * GIB + MIB, "allocations": 812}


def leak_report(findings: tuple[Finding, ...] = LEAKS) -> NodeReport:
    pids = sorted({f.pid for f in findings if f.pid is not None})
    snapshot = NodeSnapshot(
        taken_at=TAKEN_AT, hostname="gpu-node-07",
        nvml=NvmlStatus(True, driver_version="550.54.15", nvml_version="12.550.54.15"),
        gpus=(), processes=MappingProxyType({pid: process(pid) for pid in pids}),
        agents=MappingProxyType({f.pid: agent(f.pid, CUDA if f.pid == 700 else None)
                                 for f in findings
                                 if f.pid is not None and isinstance(f.details, LeakEvidence)
                                 and f.details.unit == GrowthUnit.STEP}))
    return NodeReport(snapshot, findings)
