"""The reaper: free GPU memory held by processes of dead jobs, safely.

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
  when planning, and again right before each signal (the ref's veto);
- the identity (PID and start time) is checked right before every signal, so a PID reused by a
  new process is never signalled (gpuwatch.actions.signals, the one signalling path);
- SIGTERM to every candidate first, one grace period for all, then SIGKILL to those left; a
  zombie is reaped through its parent;
- every action carried out goes to an append-only audit log (reap.jsonl): its plan before the
  first signal, its result the moment it is known, and, for a process still there at the first
  look after a signal, a "signalled" line then; one line per write(), so a reaper killed in
  the middle leaves every result and signal it had, and `AuditFollower` (the daemon) finds the
  actions such a reaper left without a result and records what became of their processes;
- a `gpuwatch run` job cgroup that the processes it ended leave empty (its supervisor was
  killed, or its helpers kept) is removed, as the supervisor removes it when it ends the job.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import functools
import json
import os
import signal
import stat
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from gpuwatch.actions.cgroup import job_cgroups_of
from gpuwatch.actions.signals import (
    GONE,
    OTHER,
    SAME,
    SETTLE,
    VETOED,
    WAITING,
    ZOMBIE,
    Ending,
    ProcessRef,
    Signaller,
    may_signal_other_users,
)
from gpuwatch.config import Config
from gpuwatch.detectors import protected_by
from gpuwatch.jobs.tree import service_over
from gpuwatch.model import KINDS, REAPABLE_KINDS, Finding, HostProcess, Job, Kind, NodeReport
from gpuwatch.runtime_dir import TrustedDir, UnsafeDirectory, open_daemon_dir, open_private_dir
from gpuwatch.sources.processes import ProcessSource
from gpuwatch.units import plural

AUDIT_NAME = "reap.jsonl"
#: Phases of an audit line: a plan (a dry run's, or one about to be carried out), a signal sent
#: to a process still there at the first look after it (no result yet), the result of carrying
#: it out, and the result found later for an action whose reaper stopped first.
PLANNED, SIGNALLED, EXECUTED, RECOVERED = "planned", "signalled", "executed", "recovered"
#: How long an emptied `gpuwatch run` job cgroup is given to let its last process go before it
#: is removed (a process leaves its cgroup a moment after it exits).
CGROUP_SETTLE = 2.0
#: How much of the audit log's end the daemon reads when it starts: actions left without a result
#: are the last ones written.
AUDIT_TAIL_BYTES = 4 << 20

#: What carrying out an action can end in (a dry run's results are all "planned").
OUTCOMES = ("exited", "killed", "reaped", "gone", "identity-changed", "refused",
            "refused-service", "unkillable", "still-running", "failed")
#: The outcome of a finding refused because its process is a service's or the daemon's (the
#: action REFUSE_SERVICE, or a signal stopped by the same check right before it was sent).
REFUSED_SERVICE = "refused-service"

#: The outcomes after which the process no longer holds anything.
FREED = frozenset({"exited", "killed", "reaped", "gone"})

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
                "job": {"id": self.job.id, "source": self.job.source} if self.job else None,
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
                      job=(Job(str(job.get("id")), str(job.get("source")))
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
                "job": {"id": self.job.id, "source": self.job.source} if self.job else None,
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


class Reaper:
    """`may_signal_others`: whether this process may signal other users' processes (CAP_KILL
    in its effective set, read from /proc/self/status when not given)."""

    def __init__(self, config: Config, audit_path: Path, daemon_pid: Optional[int] = None,
                 actor: str = "cli", euid: Optional[int] = None,
                 clock: Callable[[], float] = time.time,
                 may_signal_others: Optional[bool] = None,
                 signaller: Optional[Signaller] = None) -> None:
        self.config = config
        self.audit_path = audit_path
        self.daemon_pid = daemon_pid
        self.actor = actor
        self.euid = os.geteuid() if euid is None else euid
        self.may_signal_others = (may_signal_other_users() if may_signal_others is None
                                  else may_signal_others)
        self._signals = signaller or Signaller()
        self.audit = AuditWriter(audit_path, actor, self.euid, clock)
        #: Why a dry run's plan is not in the audit log (None: it is, or nothing was planned).
        self.unrecorded: Optional[str] = None

    # -- planning ------------------------------------------------------------------------------
    def plan(self, report: NodeReport, filters: Filters = Filters(), dry_run: bool = False,
             grace: Optional[float] = None) -> list[Action]:
        """`grace` (default: the config's) is only what the plan says; execute() takes its own.

        A dry run's plan goes to the audit log here; any other plan when execute() carries it
        out (a plan that is shown and declined was never more than a dry run)."""
        processes = report.snapshot.processes
        chosen = [f for f in report.findings if self._selected(f, report, filters)]
        candidates = {f.pid for f in chosen if f.pid is not None}
        wait = self.config.reaper.grace if grace is None else grace
        # Start times as the status document gives them (the audit log records those, and the
        # signalling path checks a process's identity against them): on the wall clock.
        wall = report.snapshot.wall
        actions = [self._action(f, processes, candidates, wait, wall) for f in chosen]
        # Zombies last: terminating their parents first is what may reap them.
        actions.sort(key=lambda a: a.action == VIA_PARENT)
        if dry_run:
            # A dry run changes nothing, so it is not refused for want of the right to record
            # it: a reader of the state directory (the gpuwatch group) may plan; `unrecorded`
            # says why the plan is not on record.
            try:
                self.audit.write([self.audit.entry(Result(a, "planned"), PLANNED, dry_run=True)
                                  for a in actions])
            except PermissionError as exc:
                self.unrecorded = audit_refusal(self.audit_path, exc)
        return actions

    def spared(self, report: NodeReport, filters: Filters) -> list[Spared]:
        """The protected processes holding GPU memory that `filters` name by --job or --pid and
        no planned action is about: the memory a reap of that job or PID leaves held. Empty
        without --job and --pid (a node's own daemons, protected, are no reap's business)."""
        if filters.job is None and not filters.pids:
            return []
        snapshot = report.snapshot
        planned = {f.pid for f in report.findings if self._selected(f, report, filters)}
        spared = []
        for pid, p in sorted(snapshot.processes.items()):
            job = report.jobs.get(pid) or p.job
            if (pid in planned or not p.in_procfs or not p.holds_gpu
                    or (filters.pids and pid not in filters.pids)
                    or (filters.job is not None and not _job_matches(job, filters.job))
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

    def check_audit_writable(self) -> None:
        """Raise AuditRefused when the audit log cannot be appended to: a reap is recorded
        before its first signal, so one that cannot be recorded must not start."""
        try:
            self.audit.touch()
        except OSError as exc:
            raise AuditRefused(audit_refusal(self.audit_path, exc)) from None

    def audit_planned(self, actions: Iterable[Action]) -> None:
        """Record plans that are not carried out (the daemon's refused auto-reaps)."""
        self.audit.write([self.audit.entry(Result(a, "planned"), PLANNED) for a in actions])

    def _selected(self, f: Finding, report: NodeReport, filters: Filters) -> bool:
        if f.kind not in filters.kinds:
            return False
        if filters.pids and f.pid not in filters.pids:
            return False
        if filters.user is not None and f.user != filters.user:
            return False
        if filters.job is not None and not _job_matches(f.job, filters.job):
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
        refusal = self._serving(f.kind, pid)
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

    def _serving(self, kind: str, pid: int) -> Optional[str]:
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

    def _veto(self, a: Action) -> Optional[Callable[[int], Optional[str]]]:
        """The check made again right before each signal to the action's process."""
        if a.kind not in SERVICE_CHECKED:
            return None
        return functools.partial(self._serving, a.kind)

    # -- acting --------------------------------------------------------------------------------
    def execute(self, actions: Iterable[Action], grace: Optional[float] = None,
                on_result: Optional[Callable[[Result], None]] = None) -> list[Result]:
        """Carry out `actions`: their plans go to the audit log before the first signal; every
        process to terminate gets SIGTERM before any grace is waited, and each result goes to
        the audit log (and to `on_result`) the moment it is known. Results in the order of
        `actions`. An audit log that cannot be written stops nothing already under way: the
        error is raised once the batch is done."""
        actions = list(actions)
        wait = self.config.reaper.grace if grace is None else grace
        batch = uuid.uuid4().hex[:12]
        ids = [f"{batch}.{i}" for i in range(len(actions))]
        self.audit.write([self.audit.entry(Result(a, "planned"), PLANNED, action_id=ids[i])
                          for i, a in enumerate(actions)])
        results: list[Optional[Result]] = [None] * len(actions)
        unwritten: list[OSError] = []

        def record(i: int, r: Result, phase: str) -> None:
            entry = self.audit.entry(r, phase, action_id=ids[i])
            if phase == SIGNALLED:
                entry["result"] = None  # none yet: the signal is on record, its outcome is not
            try:
                self.audit.write([entry])
            except OSError as exc:
                unwritten.append(exc)

        def done(i: int, r: Result) -> None:
            results[i] = r
            record(i, r, EXECUTED)
            if on_result is not None:
                on_result(r)

        terminating = []
        for i, a in enumerate(actions):
            if a.action == REFUSE:
                done(i, Result(a, "refused", a.refused or ""))
            elif a.action == REFUSE_SERVICE:
                done(i, Result(a, REFUSED_SERVICE, a.refused or ""))
            elif a.action == REPORT:
                done(i, Result(a, "unkillable" if a.kind == Kind.UNKILLABLE else "failed",
                               a.refused or ""))
            elif a.action == TERMINATE:
                terminating.append(i)
        # Read while they run: a `gpuwatch run` job whose last processes this ends (its
        # supervisor gone, or its helpers kept) would leave its cgroup behind, empty.
        cgroups = {c.path: c for i, a in enumerate(actions)
                   if a.action in (TERMINATE, VIA_PARENT)
                   for c in job_cgroups_of(a.target if a.action == TERMINATE else a.pid)}
        if terminating:
            refs = []
            for i in terminating:
                assert actions[i].target is not None
                refs.append(ProcessRef(actions[i].target, actions[i].target_start_time,
                                       veto=self._veto(actions[i])))
            self._signals.terminate_all(
                refs, wait,
                on_end=lambda j, ending: done(terminating[j],
                                              Result.of(actions[terminating[j]], ending)),
                on_waiting=lambda j, so_far: record(
                    terminating[j], Result.of(actions[terminating[j]], so_far), SIGNALLED))
        for i, a in enumerate(actions):
            if a.action == VIA_PARENT:
                done(i, self._reap_via_parent(a, functools.partial(record, i,
                                                                   phase=SIGNALLED)))
        if cgroups:
            ended = {r.action.target if r.action.action == TERMINATE else r.action.pid
                     for r in results if r is not None and r.freed}
            for cgroup in cgroups.values():
                # Removed once nothing but what just ended is in it; the last of those may
                # take a moment to leave it.
                if not cgroup.pids() - ended:
                    cgroup.remove(timeout=CGROUP_SETTLE)
        if unwritten:
            raise unwritten[0]
        return [r for r in results if r is not None]

    def _reap_via_parent(self, a: Action, signalled: Callable[[Result], None]) -> Result:
        assert a.pid is not None and a.target is not None
        zombie = ProcessRef(a.pid, a.start_time)
        if self._signals.wait_collected(zombie, 0.5):
            return Result(a, "reaped", "its parent reaped it")
        parent = ProcessRef(a.target, a.target_start_time)
        told = False
        sent: tuple[tuple[str, float], ...] = ()
        if a.target != 1:
            try:
                told = self._signals.send(parent, signal.SIGCHLD) == SAME
            except OSError as exc:
                return Result(a, "failed", f"cannot signal its parent: {exc.strerror}")
            if told:
                sent = (("SIGCHLD", time.time()),)
                if not self._signals.wait_collected(zombie, WAITING):
                    signalled(Result(a, "waiting", "SIGCHLD sent to its parent", sent))
        if self._signals.wait_collected(zombie, SETTLE):
            return Result(a, "reaped", "reaped after its parent was told (SIGCHLD)"
                          if told else "reaped by its new parent", sent)
        return Result(a, "failed", f"its parent {a.target} does not reap it: end the parent, "
                                   "or wait for it to exit", sent)


@functools.lru_cache(maxsize=4)
def _start_time_of(pid: int) -> Optional[float]:
    """This process's start time (`pid`: os.getpid(), so that a forked child reads its own)."""
    stat = ProcessSource().stat("self")
    return stat.start_time if stat is not None else None


class AuditRefused(Exception):
    """The audit log cannot be written: the message says which file, why, and who can."""


def audit_refusal(path: Path, exc: OSError) -> str:
    reason = exc.strerror or str(exc)
    who = (" (the audit log is written by root and by the daemon's user; members of the "
           "gpuwatch group may read it and run --dry-run)"
           if isinstance(exc, PermissionError) else "")
    return f"cannot write the audit log {path}: {reason}{who}"


class AuditWriter:
    """Appends to the audit log: O_APPEND, one line per write(), under an exclusive flock so
    that the check for a torn last line (a writer killed mid-write) and the append are one step:
    an entry after a torn line starts on a line of its own. Each line names the process that
    wrote it (`reaper`: PID and start time), which is how the daemon tells a reaper still at
    work from one that stopped."""

    def __init__(self, path: Path, actor: str, uid: int,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.actor = actor
        self.uid = uid
        self._clock = clock
        self.reaper = {"pid": os.getpid(), "start_time": _start_time_of(os.getpid())}

    def entry(self, r: Result, phase: str, dry_run: bool = False,
              action_id: Optional[str] = None) -> dict[str, Any]:
        return {"ts": round(self._clock(), 3), "actor": self.actor, "uid": self.uid,
                "reaper": self.reaper, "id": action_id, "phase": phase, "dry_run": dry_run,
                **r.as_json(), "sent": [{"signal": name, "at": round(at, 3)}
                                        for name, at in r.sent]}

    def write(self, entries: list[dict[str, Any]]) -> None:
        if not entries:
            return
        with self._open() as fd:
            lead = b"" if _ends_a_line(fd) else b"\n"
            for e in entries:
                _write_all(fd, lead + json.dumps(e).encode() + b"\n")
                lead = b""

    def touch(self) -> None:
        """Open the log for appending, creating it as a write would, and write nothing."""
        with self._open():
            pass

    def end_torn_line(self) -> bool:
        """End a torn last line, if there is one (so that it reads as one unreadable line, and
        the next entry starts on a line of its own). Whether there was one."""
        if not self.path.exists():
            return False
        with self._open() as fd:
            if _ends_a_line(fd):
                return False
            os.write(fd, b"\n")
            return True

    @contextlib.contextmanager
    def _open(self) -> Iterator[int]:
        flags = os.O_RDWR | os.O_APPEND  # read: the last byte, for a torn line
        with _audit_dir(self.path, create=True) as directory:
            name = self.path.name
            try:
                fd = _open_in(directory, self.path, flags | os.O_CREAT | os.O_EXCL, 0o640)
                created = True
            except FileExistsError:
                fd = _open_in(directory, self.path, flags)
                created = False
            try:
                if created and os.geteuid() == 0:
                    # Root (`gpuwatch reap` in an epilog) creating the log in the daemon's state
                    # directory: the file is the directory owner's, so that the daemon (the
                    # unit's gpuwatch account) can append to it too.
                    st = os.fstat(directory.fd)
                    with contextlib.suppress(OSError):
                        os.fchown(fd, st.st_uid, st.st_gid)
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise PermissionError(errno.EACCES, f"{name} is not a regular file")
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield fd
            finally:
                os.close(fd)


@contextlib.contextmanager
def _audit_dir(path: Path, create: bool = False) -> Iterator[TrustedDir]:
    """The audit log's state directory, checked and held open (gpuwatch.runtime_dir: no other
    user may write it, nor anything above it); made 0750 where missing when `create`. One that
    is not trusted is a PermissionError saying why: the log is not written there."""
    try:
        try:
            directory = open_daemon_dir(path.parent, setting="daemon.state_dir")
        except FileNotFoundError:
            if not create:
                raise
            directory = open_private_dir(path.parent, create_mode=0o750,
                                         setting="daemon.state_dir")
    except UnsafeDirectory as exc:
        raise PermissionError(errno.EACCES, f"refused: {exc}") from None
    with directory:
        yield directory


def _open_in(directory: TrustedDir, path: Path, flags: int, mode: int = 0o640) -> int:
    """`path` opened in its checked directory, never through a symbolic link."""
    try:
        return directory.open(path.name, flags | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermissionError(errno.EACCES, "a symbolic link: not followed") from None
        raise


def _read_audit(path: Path) -> Any:
    """The audit log, open for reading (FileNotFoundError when there is none yet)."""
    with _audit_dir(path) as directory:
        return os.fdopen(_open_in(directory, path, os.O_RDONLY), "rb")


def _write_all(fd: int, data: bytes) -> None:
    """One write() for the line; the rest of it only after a short write (a full disk)."""
    while data:
        data = data[os.write(fd, data):]


def _ends_a_line(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return size == 0 or os.pread(fd, 1, size - 1) == b"\n"


def _job_matches(job: Optional[Job], wanted: str) -> bool:
    """`--job 41234` (the id a scheduler hands its epilog) or `--job slurm:41234` (as `status`
    shows it)."""
    if job is None:
        return False
    return wanted in (job.id, str(job))


@dataclass
class AuditNews:
    """What the daemon learnt from the audit log since it last looked."""

    #: Results recorded (executed or recovered), by (finding kind, result).
    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    #: Lines that do not parse: torn by a writer killed in the middle of one.
    torn: int = 0
    #: Whether the log ended in such a line when the daemon started (now ended by a newline).
    ended_torn: bool = False
    #: The "recovered" entries written for actions a stopped reaper left without a result.
    recovered: list[dict[str, Any]] = field(default_factory=list)
    #: A new problem reading the log, or writing the recovered entries.
    error: Optional[str] = None


def _who(entry: dict[str, Any]) -> str:
    """The reaper that wrote `entry`, in words: "daemon PID 5120, started 10:27:19Z"."""
    ident = _identity(entry)
    if ident is None:
        return str(entry.get("actor"))
    pid, start_time = ident
    started = ""
    if isinstance(start_time, (int, float)):
        when = datetime.datetime.fromtimestamp(start_time, tz=datetime.timezone.utc)
        started = f", started {when:%H:%M:%S}Z"
    return f"{entry.get('actor')} PID {pid}{started}"


def _identity(entry: dict[str, Any]) -> Optional[tuple[int, Optional[float]]]:
    reaper = entry.get("reaper")
    if not isinstance(reaper, dict) or not isinstance(reaper.get("pid"), int):
        return None
    return reaper["pid"], reaper.get("start_time")


class AuditFollower:
    """The daemon's reading of the audit log, whoever writes it (`gpuwatch reap`, `top`, its own
    auto-reap), a poll at a time: it counts the results, skips and counts torn lines, remembers
    the refused auto-reap plans already recorded, and finds the actions a reaper planned and
    then stopped without a result for (killed in its grace period, say), checks what became of
    their processes and records that as a "recovered" line.

    An action is left without a result only once the process that planned it (the `reaper` of
    its line: PID and start time) is gone: a reaper still inside its grace period is not one.
    """

    def __init__(self, path: Path, writer: AuditWriter,
                 signaller: Optional[Signaller] = None) -> None:
        self.path = path
        self.writer = writer
        self._signals = signaller or Signaller()
        self.offset = 0
        #: Planned actions carried out with no result yet, by id.
        self._pending: dict[str, dict[str, Any]] = {}
        #: (pid, start_time, action, refused) of the refused auto-reap plans recorded.
        self._refusals: set[tuple[Any, ...]] = set()
        #: (pid, start_time) of the processes the log records as ended, newest last.
        self._ended: dict[tuple[Any, Any], None] = {}
        self._started = False
        self._failing: Optional[str] = None

    def poll(self) -> AuditNews:
        """What was appended since the last look, and what stopped reapers left. The first look
        (the daemon's start) reads the end of the log as it stands: earlier runs' results are
        not counted again, a torn last line is ended, and their actions without a result are
        recovered. A log that cannot be read is said once (`error`), not at every poll."""
        news = AuditNews()
        try:
            if not self._started:
                self._start(news)
                self._started = True
            self._settle(news)
        except OSError as exc:
            error = f"cannot read {self.path}: {exc.strerror or exc}"
            news.error = error if error != self._failing else None
            self._failing = error
            return news
        self._failing = None
        return news

    def _start(self, news: AuditNews) -> None:
        news.ended_torn = self.writer.end_torn_line()
        try:
            f = _read_audit(self.path)
        except FileNotFoundError:
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            begin = max(0, size - AUDIT_TAIL_BYTES)
            f.seek(begin)
            data = f.read(size - begin)
        if begin > 0:  # the first line read is only the end of one
            data = data[data.find(b"\n") + 1:]
        complete = data.rfind(b"\n") + 1
        self.offset = size - (len(data) - complete)
        # Earlier runs' results are not counted again; their torn lines are reported.
        news.torn = self._take(data[:complete], AuditNews()).torn

    def refusals_to_audit(self, refused: list[Action]) -> list[Action]:
        """Of the refused auto-reap plans of this poll, those not recorded yet: each refusal is
        recorded once per process and reason (for as long as it stays refused), not per poll."""
        keys = {self._refusal_key(a): a for a in refused}
        new = [a for key, a in keys.items() if key not in self._refusals]
        self._refusals = set(keys)
        return new

    def not_ended_yet(self, actions: list[Action]) -> list[Action]:
        """`actions` less those about a process the log already records as ended: an exited
        process stays a finding until its new parent collects it, and a daemon started again
        after a reap recovered it; neither is ended a second time (nor counted twice)."""
        return [a for a in actions if (a.pid, a.start_time) not in self._ended]

    def _note_ended(self, entry: dict[str, Any]) -> None:
        if entry.get("result") in FREED:
            self._ended[(entry.get("pid"), entry.get("start_time"))] = None
            while len(self._ended) > 10_000:  # bounded whatever a log holds
                self._ended.pop(next(iter(self._ended)))

    @staticmethod
    def _refusal_key(a: Any) -> tuple[Any, ...]:
        if isinstance(a, dict):
            return a.get("pid"), a.get("start_time"), a.get("action"), a.get("refused")
        return a.pid, a.start_time, a.action, a.refused

    def _settle(self, news: AuditNews) -> None:
        # The reapers found gone first, then their last lines: a reaper that wrote its result
        # and exited between a read and the check is never taken for one that stopped short.
        stopped = {ident for ident in {_identity(e) for e in self._pending.values()}
                   if ident is not None and not self._running(ident)}
        self._read(news)
        left = [e for e in self._pending.values() if _identity(e) in stopped]
        if left:
            self._recover(left, news)

    def _running(self, ident: tuple[int, Optional[float]]) -> bool:
        return self._signals.state(ProcessRef(*ident)) == SAME

    def _read(self, news: AuditNews) -> None:
        try:
            f = _read_audit(self.path)
        except FileNotFoundError:
            self.offset = 0
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            if size < self.offset:  # rotated (or truncated): read the new file from its start
                self.offset = 0
            f.seek(self.offset)
            data = f.read(size - self.offset)
        # Only whole lines: a line being written is read once its newline is there.
        complete = data.rfind(b"\n") + 1
        self.offset += complete
        self._take(data[:complete], news)

    def _take(self, data: bytes, news: AuditNews) -> AuditNews:
        for line in data.splitlines():
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                news.torn += 1
                continue
            if not isinstance(entry, dict):
                news.torn += 1
                continue
            phase, action_id = entry.get("phase"), entry.get("id")
            if phase == SIGNALLED and action_id in self._pending:
                self._pending[action_id]["sent"] = entry.get("sent") or []
            elif phase in (EXECUTED, RECOVERED):
                key = (str(entry.get("kind")), str(entry.get("result")))
                news.counts[key] = news.counts.get(key, 0) + 1
                self._note_ended(entry)
                if action_id is not None:
                    self._pending.pop(action_id, None)
            elif phase == PLANNED and not entry.get("dry_run"):
                if action_id is not None and entry.get("action") in (TERMINATE, VIA_PARENT):
                    self._pending[action_id] = entry
                    while len(self._pending) > 10_000:  # bounded whatever a log holds
                        self._pending.pop(next(iter(self._pending)))
                elif entry.get("actor") == "daemon" and entry.get("action") in NOT_SIGNALLED:
                    self._refusals.add(self._refusal_key(entry))
        return news

    def _recover(self, entries: list[dict[str, Any]], news: AuditNews) -> None:
        recovered = []
        for e in entries:
            self._pending.pop(e["id"], None)
            result, detail = self._became(e)
            who = _who(e)
            signals = [s.get("signal") for s in e.get("sent") or [] if isinstance(s, dict)]
            after = f" after sending {' and '.join(map(str, signals))}" if signals else ""
            r = Result(Action.from_json(e), result,
                       f"its reaper ({who}) stopped{after} before recording a result; {detail}")
            recovered.append(self.writer.entry(r, RECOVERED, action_id=e["id"]))
        try:
            self.writer.write(recovered)
        except OSError as exc:
            news.error = (f"cannot record what became of "
                          f"{plural(len(recovered), 'unfinished action')} in {self.path}: "
                          f"{exc.strerror or exc}")
            return
        news.recovered.extend(recovered)
        for entry in recovered:
            self._note_ended(entry)

    def _became(self, e: dict[str, Any]) -> tuple[str, str]:
        """What became of the process an action was about, looked at now."""
        pid, start_time = e.get("pid"), e.get("start_time")
        if not isinstance(pid, int):
            return "failed", "no process to look at"
        now = self._signals.state(ProcessRef(pid, start_time))
        if now == GONE:
            return "gone", "the process is gone"
        if now == OTHER:
            return "gone", "the process is gone; its PID now belongs to another process"
        if e.get("action") == VIA_PARENT:
            return "failed", "still a zombie (same PID and start time)"
        if now == ZOMBIE:
            return "gone", "the process has exited (its parent has yet to collect it)"
        return "still-running", ("still running (same PID and start time): not signalled "
                                 "again here; reap it again")
