"""orphan: a process of a GPU job whose launching parent has exited.

Reasons name moments by clock time, never "N s ago", and leave figures that change to their own
fields; the history keeps each reason as first given while the finding is open.

With history: the parent recorded when the process was first seen is gone. Reparenting happens
only when a parent exits, so a changed parent PID is the evidence, whoever adopted the process
(PID 1, a subreaper such as systemd --user or a container init, the launching shell).

Without history (the daemon started later, or a one-shot status): the process holds GPU memory,
sits under PID 1 or a subreaper, and its environment marks it a distributed worker. Under a
subreaper other than PID 1 it must also not lead its own process group: what a supervisor starts
on purpose leads its group, a worker orphaned from torchrun still belongs to torchrun's.

Under `gpuwatch run`, with or without history: the process names its supervisor (PID and start
time, GPUWATCH_RUN_SUPERVISOR) and that process no longer runs (common.supervisor_gone). Its
launcher and helpers count as much as its GPU holders: all of them outlived the job.
"""

from __future__ import annotations

from collections.abc import Iterator

from gpuwatch.config import DetectorConfig
from gpuwatch.detectors.common import (
    finding,
    is_protected,
    named,
    supervisor_gone,
    worker_evidence,
)
from gpuwatch.history import History
from gpuwatch.jobtree import is_supervisor
from gpuwatch.model import Finding, HostProcess, NodeSnapshot
from gpuwatch.units import clock_time


def detect(snapshot: NodeSnapshot, history: History, config: DetectorConfig
           ) -> Iterator[Finding]:
    for p in snapshot.processes.values():
        if not p.in_procfs or p.pid == 1 or p.state == "zombie" or is_protected(p, config):
            continue
        reason = supervisor_gone(p, snapshot)
        if reason is not None:
            yield finding("orphan", "critical" if p.holds_gpu else "warning", p, reason)
            continue
        h = history.get(p.identity)
        if h is not None and h.first_ppid not in (None, 0, 1) and p.ppid != h.first_ppid:
            reason = _lineage_reason(p, h.first_ppid, h.parent_start, h.parent_name, snapshot,
                                     history)
            if p.holds_gpu or _job_still_training(p, history):
                yield finding("orphan", "critical" if p.holds_gpu else "warning", p, reason)
        elif p.holds_gpu:
            reason = _environment_reason(p, snapshot, config)
            if reason is not None:
                yield finding("orphan", "critical", p, reason)


def _job_still_training(p: HostProcess, history: History) -> bool:
    """A member without GPU memory is an orphan while its job still has a live trainer; once
    every trainer is gone it is a leftover instead."""
    job = history.job_of(p)
    return job is not None and bool(job.trainers)


def _lineage_reason(p: HostProcess, parent_pid: int, parent_start: float | None,
                    parent_name: str | None, snapshot: NodeSnapshot, history: History) -> str:
    gone = history.departed((parent_pid, parent_start))
    # A parent that exited but was not reaped yet is still there, as a zombie.
    unreaped = history.get((parent_pid, parent_start))
    when = ""
    if gone is not None:
        when = f" after {clock_time(snapshot.wall(gone.last_seen))}"
    elif unreaped is not None and unreaped.zombie_since is not None:
        when = f" before {clock_time(snapshot.wall(unreaped.zombie_since))} (not reaped yet)"
    adopter = snapshot.processes.get(p.ppid) if p.ppid else None
    return (f"parent {named(parent_pid, parent_name)} exited{when}; "
            f"now under {named(p.ppid, adopter.name if adopter else None)}")


def _environment_reason(p: HostProcess, snapshot: NodeSnapshot, config: DetectorConfig
                        ) -> str | None:
    parent = snapshot.processes.get(p.ppid) if p.ppid else None
    if parent is None or not is_supervisor(parent):
        return None
    if parent.pid != 1 and p.pgid == p.pid:
        return None  # started on purpose by its supervisor: it leads its own group
    if p.start_time is not None and snapshot.taken_at - p.start_time < config.min_age:
        return None
    evidence = worker_evidence(p)
    if evidence is None:
        return None  # a service under PID 1 (persistenced, a notebook server) is no orphan
    under = "PID 1" if parent.pid == 1 else named(parent.pid, parent.name)
    return f"reparented to {under}; environment has {evidence}"
