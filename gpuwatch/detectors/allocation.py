"""unallocated: a process of a Kubernetes pod holding memory on a GPU the kubelet did not
allocate to that pod.

The kubelet's PodResources service says which devices each container was given
(gpuwatch.sources.pods; NodeSnapshot.pods): GPU UUIDs, or indexes under the device plugin's
index strategy, with `::N` appended for a shared (time-sliced) replica. A process whose cgroup is
that pod's, holding memory on a GPU none of its containers was given, is outside its allocation:
a pod run with NVIDIA_VISIBLE_DEVICES=all (or privileged) that asked for no GPU or fewer, a
device plugin that handed out what another pod holds, a process of a deleted pod's left on a
GPU that now belongs to another. The evidence is the allocation itself, so nothing is said where
the kubelet did not answer for the pod (`listed` is not True), where its devices came by Dynamic
Resource Allocation (named by claim, not GPU), or where they are MIG devices (the snapshot holds
the parent GPU's UUID, not the MIG instance's).
"""

from __future__ import annotations

from collections.abc import Iterator

from gpuwatch.config import DetectorConfig
from gpuwatch.detectors.common import Evidence, is_protected
from gpuwatch.history import History
from gpuwatch.model import Finding, HostProcess, Kind, NodeSnapshot, Pod
from gpuwatch.units import human_bytes
from gpuwatch.vocabulary import Severity

#: The kinds of finding this detector reports (a test runs it over scenarios and checks).
EMITS = frozenset({Kind.UNALLOCATED})


def detect(snapshot: NodeSnapshot, history: History, config: DetectorConfig
           ) -> Iterator[Finding]:
    for p in snapshot.processes.values():
        if not p.in_procfs or not p.holds_gpu or not p.pod_uid or is_protected(p, config):
            continue
        pod = snapshot.pods.get(p.pod_uid)
        if pod is None or pod.listed is not True or pod.dynamic_resources:
            continue
        given = {d.split("::", 1)[0] for d in pod.gpu_devices}
        if any(d.startswith("MIG-") for d in given):
            continue
        outside = [u for u in p.gpu_usage
                   if u.gpu_uuid not in given and str(u.gpu_index) not in given]
        if not outside:
            continue
        yield _finding(p, pod, outside, given)


def _finding(p: HostProcess, pod: Pod, outside: list, given: set[str]  # type: ignore[type-arg]
             ) -> Finding:
    gpus = tuple(sorted({u.gpu_index for u in outside}))
    known = [u.memory_bytes for u in outside if u.memory_bytes is not None]
    memory = sum(known) if known else None
    on = ", ".join(f"GPU {u.gpu_index} ({u.gpu_uuid or 'no UUID'})" for u in
                   sorted(outside, key=lambda u: u.gpu_index))
    allocated = ", ".join(sorted(given)) if given else "no GPU"
    held = human_bytes(memory) if memory is not None else "memory"
    where = "GPU " + ",".join(map(str, gpus)) if len(gpus) == 1 else "GPUs " + ",".join(
        map(str, gpus))
    outside_of = (f"outside the {len(given)} GPU device(s) the kubelet allocated its pod"
                  if given else "and the kubelet allocated its pod no GPU")
    evidence = Evidence(
        f"holds {held} on {on}, which the kubelet did not allocate to pod {pod.full_name}: "
        f"its containers were given {allocated}",
        f"holds {held} on {where}, {outside_of} (UID {pod.uid})")
    return Finding(kind=Kind.UNALLOCATED, severity=Severity.WARNING, reason=evidence.reason,
                   summary=evidence.summary, pid=p.pid, start_time=p.start_time, name=p.name,
                   user=p.user, job=p.job, gpus=gpus, gpu_memory_bytes=memory)
