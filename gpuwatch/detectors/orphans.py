"""orphan: a process of a GPU job whose launching parent has exited.

Reasons name moments by clock time, never "N s ago", and leave figures that change to their own
fields; the history keeps each reason as first given while the finding is open.

With history: the parent recorded when the process was first seen is gone. Reparenting happens
only when a parent exits, so a changed parent PID is the evidence, whoever adopted the process
(PID 1, a subreaper such as systemd --user or a container init, the launching shell).

Without history (the daemon started later, or a one-shot status), or with a history that saw no
other parent: the process holds GPU memory, is older than `min_age`, its environment marks it a
distributed worker, and its parent shows it adopted it (`_adopter`): PID 1; a supervisor known
by name; or, for a worker whose environment only a launcher's agent can have set, PID 1 of the
process's own PID namespace (a container's init: `bash -c "torchrun ...; cleanup"`, `sleep`, an
entrypoint) or a parent outside the process group whose leader has exited (the launcher led it:
a subreaper of any name). Except under PID 1, the process must not
lead its own group (what an init or a supervisor starts on purpose does) unless a torchrun agent
started it, and the parent must not be one that may be its live launcher (`_may_have_launched`).

On Kubernetes, with or without history: the process holds GPU memory in the cgroup of a pod
the kubelet no longer lists (deleted while its process lives on: a container's init that
escaped, a process that left the container's cgroup scope); the reason names the pod.

Under `gpuwatch run`, with or without history: the process names its supervisor (PID and start
time, GPUWATCH_RUN_SUPERVISOR) and that process no longer runs (common.supervisor_gone). Its
launcher and helpers count as much as its GPU holders: all of them outlived the job.
"""

from __future__ import annotations

from collections.abc import Iterator

from gpuwatch.config import DetectorConfig
from gpuwatch.detectors.common import (
    Evidence,
    by_holding,
    finding,
    gpu_words,
    is_protected,
    pid_named,
    process_named,
    supervisor_gone,
    worker_evidence,
)
from gpuwatch.history import History
from gpuwatch.jobs.tree import is_launcher, is_namespace_init, is_supervisor
from gpuwatch.launch_env import (
    LAUNCHER_SET_KEYS,
    RUN_SUPERVISOR_KEY,
    TORCHELASTIC_RUN_ID_KEY,
    WORKER_MARKER_KEYS,
)
from gpuwatch.model import Finding, HostProcess, Kind, NodeSnapshot
from gpuwatch.units import clock_time
from gpuwatch.vocabulary import ProcState, Severity

#: The kinds of finding this detector reports (a test runs it over scenarios and checks).
EMITS = frozenset({Kind.ORPHAN})


def detect(snapshot: NodeSnapshot, history: History, config: DetectorConfig
           ) -> Iterator[Finding]:
    for p in snapshot.processes.values():
        if not p.in_procfs or p.pid == 1 or p.state == ProcState.ZOMBIE or is_protected(p, config):
            continue
        # (Asked only of the processes that name a supervisor, or hold GPU memory in a pod's
        # cgroup: the others, most, cannot be orphaned either way.)
        evidence = (supervisor_gone(p, snapshot) if RUN_SUPERVISOR_KEY in p.launch_env
                    else None)
        if evidence is not None:
            yield finding(Kind.ORPHAN, by_holding(p), p, evidence)
            continue
        evidence = _pod_gone(p, snapshot) if p.pod_uid and p.gpu_usage else None
        if evidence is not None:
            yield finding(Kind.ORPHAN, Severity.CRITICAL, p, evidence)
            continue
        h = history.get(p.identity)
        if h is not None and h.first_ppid not in (None, 0, 1) and p.ppid != h.first_ppid:
            evidence = _lineage_reason(p, h.first_ppid, h.parent_start, h.parent_name,
                                       h.parent_comm, snapshot, history)
            if p.holds_gpu or _job_still_training(p, history):
                yield finding(Kind.ORPHAN, by_holding(p), p, evidence)
        elif p.holds_gpu:
            found = _environment_reason(p, snapshot, config)
            if found is not None:
                yield finding(Kind.ORPHAN, Severity.CRITICAL, p, found)


def _pod_gone(p: HostProcess, snapshot: NodeSnapshot) -> Evidence | None:
    """A process holding GPU memory in the cgroup of a pod the kubelet no longer lists (two
    answers in a row: gpuwatch.sources.pods): the pod was deleted, and this outlived it."""
    pod = snapshot.pods.get(p.pod_uid) if p.holds_gpu and p.pod_uid else None
    if pod is None or pod.listed is not False:
        return None
    since = (f" since {clock_time(snapshot.wall(pod.gone_since))}"
             if pod.gone_since is not None else "")
    return Evidence(f"pod {pod.full_name} (UID {pod.uid}) is gone from the kubelet's pods{since}"
                    f"; its process still holds {gpu_words(p)}",
                    f"pod UID {pod.uid} is gone from the kubelet's pods{since}; its process "
                    f"still holds {gpu_words(p)}")


def _job_still_training(p: HostProcess, history: History) -> bool:
    """A member without GPU memory is an orphan while its job still has a live trainer; once
    every trainer is gone it is a leftover instead."""
    job = history.job_of(p)
    return job is not None and bool(job.trainers)


def _lineage_reason(p: HostProcess, parent_pid: int, parent_start: float | None,
                    parent_name: str | None, parent_comm: str | None, snapshot: NodeSnapshot,
                    history: History) -> Evidence:
    gone = history.departed((parent_pid, parent_start))
    # A parent that exited but was not reaped yet is still there, as a zombie.
    unreaped = history.get((parent_pid, parent_start))
    when = ""
    if gone is not None:
        when = f" after {clock_time(snapshot.wall(gone.last_seen))}"
    elif unreaped is not None and unreaped.zombie_since is not None:
        when = f" before {clock_time(snapshot.wall(unreaped.zombie_since))} (not reaped yet)"
    adopter = snapshot.processes.get(p.ppid) if p.ppid else None
    return Evidence.join("parent ", pid_named(parent_pid, parent_name, parent_comm),
                         f" exited{when}; now under ", process_named(adopter, p.ppid))


def _environment_reason(p: HostProcess, snapshot: NodeSnapshot, config: DetectorConfig
                        ) -> Evidence | None:
    parent = snapshot.processes.get(p.ppid) if p.ppid else None
    if parent is None or not parent.in_procfs:
        return None
    if p.start_time is not None and snapshot.taken_at - p.start_time < config.min_age:
        return None
    # The parent first: at every poll, for every GPU holder, it is most often the live
    # launcher, which settles it without the environment's words.
    adopter = _adopter(p, parent, bool(p.gpu_usage) and p.pgid in snapshot.gone_group_leaders)
    if adopter is None:
        return None
    evidence = worker_evidence(p)
    if evidence is None:
        return None  # a service under PID 1 (persistenced, a notebook server) is no orphan
    # The summary names the marker variables (gpuwatch's own list), never their values.
    markers = ", ".join(sorted(k for k in p.launch_env if k in WORKER_MARKER_KEYS))
    return Evidence(f"reparented to {adopter.reason}; environment has {evidence}",
                    f"reparented to {adopter.summary}; environment has {markers}")


def _adopter(p: HostProcess, parent: HostProcess, leader_gone: bool) -> Evidence | None:
    """The parent in words when it shows that it adopted `p` rather than started it, else None.
    `leader_gone`: `p` holds GPU memory and its process group's leader, another process, has
    exited (NodeSnapshot.gone_group_leaders).

    The kernel gives an orphan to the nearest child subreaper above it, else to PID 1 of its PID
    namespace. The subreaper flag is not shown in /proc, so a subreaper is known by its name
    (SUPERVISORS), or by the process group its exited launcher led, which outlives it.
    """
    if parent.pid == 1:
        return Evidence.public("PID 1")  # the host's init never launches ranks
    # (Named only once it may be the adopter: most GPU holders' parent is their live launcher.)
    if is_supervisor(parent):
        adopter = process_named(parent, parent.pid)
    elif not p.launch_env.keys() & LAUNCHER_SET_KEYS:
        # A container's init or an entrypoint may start ranks itself (a shell loop setting RANK
        # and LOCAL_RANK): only a variable a launcher sets says another process started it.
        return None
    elif is_namespace_init(parent, p):
        adopter = Evidence.join(process_named(parent, parent.pid), ", PID 1 of its PID namespace")
    elif leader_gone and p.pgid is not None and parent.pgid != p.pgid:
        gone = f"; the leader of its process group, {p.pgid}, has exited"
        adopter = Evidence.join(process_named(parent, parent.pid), gone)
    else:
        return None
    if p.pgid == p.pid and TORCHELASTIC_RUN_ID_KEY not in p.launch_env:
        # What an init or a supervisor starts on purpose (the container's command) leads its
        # own group. torchrun's workers do too, but only a torchrun agent sets its run id.
        return None
    if _may_have_launched(parent, p):
        return None
    return adopter


def _may_have_launched(parent: HostProcess, p: HostProcess) -> bool:
    """Whether `parent` may be `p`'s own launcher, still running: a distributed launcher, a rank
    that starts ranks (it holds GPU memory or has rank variables itself, as Lightning's rank 0
    does), or a program whose copy `p` is (forked without exec, or multiprocessing's child)."""
    if is_launcher(parent) or parent.holds_gpu or worker_evidence(parent) is not None:
        return True
    return bool(p.cmdline) and (p.cmdline == parent.cmdline
                                or "--multiprocessing-fork" in p.cmdline)
