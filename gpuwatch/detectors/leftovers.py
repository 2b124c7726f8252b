"""leftover: a job member still running after the job's last trainer ended.

The trainers of a job are its members that held GPU memory; when the last of them has exited, or
told the agent it finished, the job is over, and what is still alive after the grace period (the
redis, the actor, the preprocessor) is a leftover, named by its command. The launcher itself is
not reported: it is typically waiting for those very helpers, and ends with them. A member whose
`gpuwatch run` supervisor is gone is an orphan instead, from the first poll that sees it, and is
not reported twice.

A common parent is not enough: a notebook server, a cluster manager or a test harness is the
parent of its GPU holder as a launcher is of its workers, and outlives it with other children
that are live work. So a tree's members are leftovers only where the tree shows that it was one
job (`job_evidence`): its trainers were started by a distributed launcher, as ranks by one (a
variable only a launcher's agent sets, which their parent lacks) or under `gpuwatch run`, or a
trainer told the agent it finished. Only what the job started counts (seen under a trainer or
their launcher, not a login shell's other children). And never where the tree still holds a
service (jobs.tree.is_service: a raylet, a notebook server, a kernel), nor the process that took
the snapshot, the daemon itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

from gpuwatch.config import DetectorConfig
from gpuwatch.detectors.common import (
    Evidence,
    command,
    finding,
    is_protected,
    named,
    pid_named,
    supervisor_gone,
)
from gpuwatch.history import History
from gpuwatch.jobs.records import JobRecord
from gpuwatch.jobs.tree import is_launcher, is_login_shell, is_service, lineage
from gpuwatch.launch_env import LAUNCHER_SET_KEYS, RUN_ID_KEY
from gpuwatch.model import Finding, HostProcess, Kind, NodeSnapshot
from gpuwatch.units import clock_time
from gpuwatch.vocabulary import ProcState, Severity

#: The kinds of finding this detector reports (a test runs it over scenarios and checks).
EMITS = frozenset({Kind.LEFTOVER})


def detect(snapshot: NodeSnapshot, history: History, config: DetectorConfig
           ) -> Iterator[Finding]:
    for job in history.jobs():
        if job.finished_at is None or snapshot.taken_at - job.finished_at < config.leftover_grace:
            continue
        if job_evidence(job) is None or _hosts_a_service(job, snapshot):
            continue
        trainer_pid, trainer_name = job.last_trainer or (None, None)
        for identity in sorted(job.members, key=lambda i: i[0]):
            p = snapshot.processes.get(identity[0])
            if p is None or p.identity != identity or p.pid == job.root_pid:
                continue
            if identity in job.launchers or not _launched_by_the_job(job, identity):
                continue
            if p.state == ProcState.ZOMBIE or is_protected(p, config):
                continue  # a zombie is reported as one, whatever its job
            if _under_observer(p, snapshot):
                continue
            if supervisor_gone(p, snapshot) is not None:
                continue  # an orphan already, since its supervisor went
            label = f" of job {job.label}" if job.label else ""
            ended = clock_time(snapshot.wall(job.finished_at))
            # The summary names the process by PID and kernel name, not by its command line.
            what = Evidence.reason_only(f"`{command(p)}`{label} ")
            if p.pid == trainer_pid:
                evidence = Evidence.join(what, f"told the agent it finished after {ended} but "
                                               "still runs")
            else:
                evidence = Evidence.join(what, "still runs; its trainer ",
                                         pid_named(trainer_pid, trainer_name,
                                                   job.last_trainer_comm),
                                         f" ended after {ended}")
            yield finding(Kind.LEFTOVER, Severity.WARNING, p, evidence)


def job_evidence(job: JobRecord) -> Optional[str]:
    """What shows that the tree was one job that has finished, not a long-lived parent's
    children, in words; None where nothing does (its members are then never leftovers)."""
    for launcher in job.launchers.values():
        if is_launcher(launcher) and not is_service(launcher):
            return (f"its trainers were started by {named(launcher.pid, launcher.name)}, a "
                    "distributed launcher")
    started_by_launcher = sorted(job.launcher_set_env & LAUNCHER_SET_KEYS)
    if started_by_launcher:
        return f"its trainers were started as ranks by a launcher ({started_by_launcher[0]})"
    if RUN_ID_KEY in job.trainer_env:
        return "its trainers ran under `gpuwatch run`"
    if job.agent_finished:
        return "a trainer told the agent it finished"
    return None


def _launched_by_the_job(job: JobRecord, identity: tuple[int, Optional[float]]) -> bool:
    """Whether the member was started under one of the job's trainers, or under the process
    that started them, other than a login shell (whose other children are the user's: an
    editor in an interactive Slurm allocation shares the job's tree)."""
    anchor = job.launched_by.get(identity)
    if anchor is None:
        return False
    launcher = job.launchers.get(anchor)
    return launcher is None or not is_login_shell(launcher)


def _hosts_a_service(job: JobRecord, snapshot: NodeSnapshot) -> bool:
    """Whether the tree's root (as first seen) or a live member shows a service's shape: its
    GPU holders were one piece of a service's work, and the service's other children are
    live."""
    if job.root is not None and is_service(job.root):
        return True
    for identity in job.members:
        p = snapshot.processes.get(identity[0])
        if p is not None and p.identity == identity and is_service(p):
            return True
    return False


def _under_observer(p: HostProcess, snapshot: NodeSnapshot) -> bool:
    """Whether `p` is the process that took the snapshot (the daemon), or runs under it."""
    observer = snapshot.observer_pid
    return observer is not None and any(q.pid == observer
                                        for q in lineage(p, snapshot.processes))
