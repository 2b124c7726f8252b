"""A reap's plan: which findings it takes, what it does to each, and what it refuses.

It plans from a report (the daemon's view, read back from its status document, or one poll),
so `reap --dry-run` shows exactly what the daemon sees. Safety, in order of precedence:
- only findings of reapable kinds are candidates; what signals cannot end (unkillable) or where
  there is no process (a ghost) is reported, never signalled;
- never PID 1, the daemon itself (by PID, whatever it is named), kernel threads, or a protected
  process (gpuwatch.detectors.protected_by: its uid, system unit or root's executable, never its
  name); another user's process only with CAP_KILL (what the kernel asks, not uid 0) and only
  where the policy allows it; a protected GPU holder that a reap's --job or --pid names is said
  (`Spared`), so that its caller knows the memory stays held;
- a `leftover` that is a service's own process (jobs.tree.is_service: a raylet's agent, a notebook
  kernel) or that runs under a live service or under the daemon, and an `orphan` that runs under
  one (a service that adopted it as a subreaper: its own work), is refused (`refuse-service`),
  whatever the findings say: they may come from a document (an earlier daemon's, a status
  document read back) and the detector is not the only gate. Checked on the live process tree
  when planning, and again right before each signal (`Planner.veto`).

Carrying a plan out is gpuwatch.actions.reaper's; recording it, gpuwatch.actions.reap_audit's.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

from gpuwatch.actions.signals import VETOED, Ending
from gpuwatch.config import Config
from gpuwatch.detectors import protected_by
from gpuwatch.jobs.tree import service_over
from gpuwatch.model import KINDS, REAPABLE_KINDS, Finding, HostProcess, Job, Kind, NodeReport
from gpuwatch.sources.processes import ProcessSource
from gpuwatch.vocabulary import FINAL_OUTCOMES, FREED_OUTCOMES, ReapOutcome

#: What carrying out an action can end in (a dry run's results are all "planned"; "waiting" is
#: said while a signalled process is given time to go, and is no end).
OUTCOMES = FINAL_OUTCOMES
#: The outcome of a finding refused because its process is a service's or the daemon's (the
#: action REFUSE_SERVICE, or a signal stopped by the same check right before it was sent).
REFUSED_SERVICE = ReapOutcome.REFUSED_SERVICE

#: The outcomes after which the process no longer holds anything.
FREED = FREED_OUTCOMES

TERMINATE = "terminate"
VIA_PARENT = "reap-via-parent"
REPORT = "report"
REFUSE = "refuse"
REFUSE_SERVICE = "refuse-service"
#: The actions that signal nothing: said, recorded, never carried out.
NOT_SIGNALLED = frozenset({REPORT, REFUSE, REFUSE_SERVICE})
#: The kinds the service check applies to, and whether to the process itself too: a leftover is
#: a live process that something judged finished; an orphan's parent is gone, and a service
#: whose child it was is no longer above it, unless the service adopted it (a subreaper).
SERVICE_CHECKED = {Kind.LEFTOVER: True, Kind.ORPHAN: False}


@dataclass(frozen=True)
class Filters:
    #: Kinds, or their names (`reap --kind`, the config's auto_kinds): a Kind is its name.
    kinds: frozenset[str] = REAPABLE_KINDS
    job: Optional[str] = None
    pids: frozenset[int] = frozenset()
    user: Optional[str] = None
    older_than: float = 0.0
    #: `reap --pod NAMESPACE/NAME`: a Kubernetes pod's processes, by the names the node gives.
    pod: Optional[str] = None


@dataclass(frozen=True)
class Action:
    kind: Kind
    action: str
    reason: str
    pid: Optional[int]
    #: As the status document gives it: on the wall clock, in hundredths of a second.
    start_time: Optional[float]
    name: Optional[str] = None
    user: Optional[str] = None
    job: Optional[Job] = None
    gpu_memory_bytes: Optional[int] = None
    gpus: tuple[int, ...] = ()
    #: The process that gets the signal: the finding's, or a zombie's parent.
    target: Optional[int] = None
    target_start_time: Optional[float] = None
    signals: tuple[str, ...] = ()
    refused: Optional[str] = None

    def as_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_time": self.start_time, "name": self.name,
                "user": self.user,
                "job": _job_json(self.job),
                "kind": self.kind, "action": self.action,
                "target": self.target, "signals": list(self.signals),
                "gpu_memory_bytes": self.gpu_memory_bytes, "gpus": list(self.gpus),
                "reason": self.reason, "refused": self.refused}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Action:
        """The action of an audit line (its target's start time is not recorded)."""
        job, kind = d.get("job"), d.get("kind")
        return Action(kind=Kind(kind) if kind in KINDS else kind,  # type: ignore[arg-type]
                      action=str(d.get("action")),
                      reason=str(d.get("reason")), pid=d.get("pid"),
                      start_time=d.get("start_time"), name=d.get("name"), user=d.get("user"),
                      job=(Job(str(job.get("id")), str(job.get("source")),
                               namespace=job.get("namespace"), pod=job.get("pod"),
                               container=job.get("container"))
                           if isinstance(job, dict) else None),
                      gpu_memory_bytes=d.get("gpu_memory_bytes"),
                      gpus=tuple(d.get("gpus") or ()), target=d.get("target"),
                      signals=tuple(d.get("signals") or ()), refused=d.get("refused"))


@dataclass(frozen=True)
class Spared:
    """A process holding GPU memory that a reap's --job or --pid names, left alone because it
    is protected: no detector reports it, so no action is planned for it, and its memory stays
    held. Said so that the reap's caller (an epilog) does not read "nothing held"."""

    pid: int
    start_time: Optional[float]
    name: Optional[str]
    user: Optional[str]
    job: Optional[Job]
    gpu_memory_bytes: Optional[int]
    gpus: tuple[int, ...]
    #: Why it is protected (protected_by's words).
    protected: str

    def as_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_time": self.start_time, "name": self.name,
                "user": self.user,
                "job": _job_json(self.job),
                "gpu_memory_bytes": self.gpu_memory_bytes, "gpus": list(self.gpus),
                "protected": self.protected}


@dataclass(frozen=True)
class Result:
    action: Action
    #: "planned", or one of OUTCOMES
    result: str
    detail: str = ""
    #: The signals sent, each with when (seconds since the epoch): (("SIGTERM", 1700000000.1),)
    sent: tuple[tuple[str, float], ...] = ()

    @property
    def freed(self) -> bool:
        return self.result in FREED

    def as_json(self) -> dict[str, Any]:
        return {**self.action.as_json(), "result": self.result, "detail": self.detail}

    @staticmethod
    def of(action: Action, ending: Ending) -> Result:
        result = REFUSED_SERVICE if ending.result == VETOED else ending.result
        return Result(action, result, ending.detail, tuple(zip(ending.sent, ending.sent_at)))


class Planner:
    """Plans a reap for one reaper: `daemon_pid` (never signalled, nor its children of the
    services check), `euid` (whose processes are its own) and `may_signal_others` (whether it
    may signal other users' processes: CAP_KILL)."""

    def __init__(self, config: Config, daemon_pid: Optional[int], euid: int,
                 may_signal_others: bool) -> None:
        self.config = config
        self.daemon_pid = daemon_pid
        self.euid = euid
        self.may_signal_others = may_signal_others

    def plan(self, report: NodeReport, filters: Filters, grace: Optional[float] = None
             ) -> list[Action]:
        """The actions for the findings `filters` select, zombies last. `grace` (default: the
        config's) is only what the plan says: carrying it out takes its own."""
        processes = report.snapshot.processes
        chosen = [f for f in report.findings if self.selected(f, report, filters)]
        candidates = {f.pid for f in chosen if f.pid is not None}
        wait = self.config.reaper.grace if grace is None else grace
        # Start times as the status document gives them (the audit log records those, and the
        # signalling path checks a process's identity against them): on the wall clock.
        wall = report.snapshot.wall
        actions = [self._action(f, processes, candidates, wait, wall) for f in chosen]
        # Zombies last: terminating their parents first is what may reap them.
        actions.sort(key=lambda a: a.action == VIA_PARENT)
        return actions

    def spared(self, report: NodeReport, filters: Filters) -> list[Spared]:
        """The protected processes holding GPU memory that `filters` name by --job or --pid and
        no planned action is about: the memory a reap of that job or PID leaves held. Empty
        without --job and --pid (a node's own daemons, protected, are no reap's business)."""
        if filters.job is None and not filters.pids and filters.pod is None:
            return []
        snapshot = report.snapshot
        planned = {f.pid for f in report.findings if self.selected(f, report, filters)}
        spared = []
        for pid, p in sorted(snapshot.processes.items()):
            job = report.jobs.get(pid) or p.job
            if (pid in planned or not p.in_procfs or not p.holds_gpu
                    or (filters.pids and pid not in filters.pids)
                    or (filters.job is not None and not _job_matches(job, filters.job))
                    or (filters.pod is not None and not _pod_matches(job, filters.pod))
                    or (filters.user is not None and p.user != filters.user)):
                continue
            why = protected_by(p, self.config.detectors)
            if why is not None:
                wall = snapshot.wall
                spared.append(Spared(
                    pid=pid, start_time=(round(wall(p.start_time), 2)
                                         if p.start_time is not None else None),
                    name=p.name, user=p.user, job=job, gpu_memory_bytes=p.gpu_memory_bytes,
                    gpus=tuple(sorted({u.gpu_index for u in p.gpu_usage})), protected=why))
        return spared

    def selected(self, f: Finding, report: NodeReport, filters: Filters) -> bool:
        if f.kind not in filters.kinds:
            return False
        if filters.pids and f.pid not in filters.pids:
            return False
        if filters.user is not None and f.user != filters.user:
            return False
        if filters.job is not None and not _job_matches(f.job, filters.job):
            return False
        if filters.pod is not None and not _pod_matches(f.job, filters.pod):
            return False
        return report.snapshot.taken_at - f.since >= filters.older_than

    def _action(self, f: Finding, processes: Mapping[int, HostProcess], candidates: set[int],
                grace: float, wall: Callable[[float], float]) -> Action:
        def started(t: Optional[float]) -> Optional[float]:
            return round(wall(t), 2) if t is not None else None

        pid = f.pid
        proc = processes.get(pid) if pid is not None else None
        base = {"kind": f.kind, "reason": f.reason, "pid": pid,
                "start_time": started(f.start_time), "name": f.name, "user": f.user,
                "job": f.job, "gpu_memory_bytes": f.gpu_memory_bytes, "gpus": f.gpus}
        if f.kind == Kind.UNKILLABLE:
            return Action(action=REPORT, **base,
                          refused="in uninterruptible sleep: signals cannot end it")
        if pid is None or proc is None or not proc.in_procfs:
            return Action(action=REPORT, **base,
                          refused="no process to signal: only the driver can release it")
        refusal = self._refusal(proc)
        if refusal is not None:
            return Action(action=REFUSE, **base, refused=refusal)
        refusal = self.serving(f.kind, pid)
        if refusal is not None:
            return Action(action=REFUSE_SERVICE, **base, refused=refusal)
        if f.kind == Kind.ZOMBIE and (proc.num_threads or 0) <= 1:
            parent = processes.get(proc.ppid) if proc.ppid is not None else None
            if parent is None:
                return Action(action=REFUSE, **base, refused="its parent is not known")
            if parent.pid in candidates:
                signals: tuple[str, ...] = (f"none: its parent {parent.pid} is reaped too",)
            else:
                refusal = self._refusal(parent)
                if refusal is not None and parent.pid != 1:
                    return Action(action=REFUSE, **base, refused=f"its parent is {refusal}")
                signals = (f"SIGCHLD to its parent {parent.pid}",)
            return Action(action=VIA_PARENT, **base, target=parent.pid,
                          target_start_time=started(parent.start_time), signals=signals)
        return Action(action=TERMINATE, **base, target=pid,
                      target_start_time=started(f.start_time),
                      signals=("SIGTERM", f"SIGKILL after {grace:g} s"))

    def _refusal(self, proc: HostProcess) -> Optional[str]:
        pid, user = proc.pid, proc.user or ""
        if pid <= 1:
            return "PID 1"
        # By PID, never by name: the daemon runs as `python3 -m gpuwatch.daemon`.
        if pid == self.daemon_pid or pid == os.getpid():
            return "the gpuwatch daemon itself" if pid == self.daemon_pid else "gpuwatch itself"
        if pid == 2 or proc.ppid == 2:
            return "a kernel thread"
        protected = protected_by(proc, self.config.detectors)
        if protected is not None:
            return f"protected: {protected}"
        if proc.uid is not None and proc.uid != self.euid:
            if not self.may_signal_others:
                return (f"another user's process ({user}): signalling it needs CAP_KILL, "
                        "which this reaper lacks")
            if not self.config.reaper.allow_other_users:
                return f"another user's process ({user}): reaper.allow_other_users is off"
        return None

    def serving(self, kind: str, pid: int) -> Optional[str]:
        """Why a `leftover` or an `orphan` must not be ended: it is live work of a service or of
        the daemon (jobs.tree.service_over), read from /proc now, not from the findings' snapshot;
        None where it is not (or is gone: the identity check before each signal says so)."""
        if kind not in SERVICE_CHECKED:
            return None
        live = ProcessSource().read([pid]).processes
        p = live.get(pid)
        if p is None or not p.in_procfs:
            return None
        over = service_over(p, live, observer=self.daemon_pid, itself=SERVICE_CHECKED[kind])
        if over is None:
            return None
        if over.pid == self.daemon_pid:
            return f"a child of the gpuwatch daemon (PID {over.pid})"
        name = over.name or "?"
        return (f"a service ({name} {over.pid})" if over is p
                else f"a child of a service ({name} {over.pid})")

    def veto(self, a: Action) -> Optional[Callable[[int], Optional[str]]]:
        """The check made again right before each signal to the action's process."""
        if a.kind not in SERVICE_CHECKED:
            return None
        return functools.partial(self.serving, a.kind)


def _job_json(job: Optional[Job]) -> Optional[dict[str, Any]]:
    if job is None:
        return None
    doc: dict[str, Any] = {"id": job.id, "source": job.source}
    if job.namespace and job.pod:
        doc.update(namespace=job.namespace, pod=job.pod, container=job.container)
    return doc


def _pod_matches(job: Optional[Job], wanted: str) -> bool:
    """`--pod NAMESPACE/NAME`: the pod the node names so (gpuwatch.sources.pods)."""
    return job is not None and job.pod_name == wanted


def _job_matches(job: Optional[Job], wanted: str) -> bool:
    """`--job 41234` (the id a scheduler hands its epilog) or `--job slurm:41234` (as `status`
    shows it)."""
    if job is None:
        return False
    return wanted in (job.id, str(job))
