"""The reaper: free GPU memory held by processes of dead jobs, safely.

It carries out a plan (gpuwatch.actions.reap_plan: what is taken, what is refused, and why),
recording it in the audit log (gpuwatch.actions.reap_audit):
- the identity (PID and start time) is checked right before every signal, so a PID reused by a
  new process is never signalled (gpuwatch.actions.signals, the one signalling path), and a
  `leftover` or an `orphan` found to be a service's work by then is refused (the plan's veto);
- SIGTERM to every candidate first, one grace period for all, then SIGKILL to those left; a
  zombie is reaped through its parent;
- every action carried out goes to the append-only audit log: its plan before the first
  signal, its result the moment it is known;
- a `gpuwatch run` job cgroup that the processes it ended leave empty (its supervisor was
  killed, or its helpers kept) is removed, as the supervisor removes it when it ends the job.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Callable, Optional

from gpuwatch.actions.cgroup import job_cgroups_of
from gpuwatch.actions.reap_audit import (
    EXECUTED,
    PLANNED,
    SIGNALLED,
    AuditRefused,
    AuditWriter,
    audit_refusal,
)
from gpuwatch.actions.reap_plan import (
    REFUSE,
    REFUSE_SERVICE,
    REFUSED_SERVICE,
    REPORT,
    TERMINATE,
    VIA_PARENT,
    Action,
    Filters,
    Planner,
    Result,
    Spared,
)
from gpuwatch.actions.signals import (
    SAME,
    SETTLE,
    WAITING,
    ProcessRef,
    Signaller,
    may_signal_other_users,
)
from gpuwatch.config import Config
from gpuwatch.model import Kind, NodeReport
from gpuwatch.vocabulary import ReapOutcome

#: How long an emptied `gpuwatch run` job cgroup is given to let its last process go before it
#: is removed (a process leaves its cgroup a moment after it exits).
CGROUP_SETTLE = 2.0

#: A plan's filters where none are given: every reapable kind, any job, PID or user.
_EVERY = Filters()


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
        uid = os.geteuid() if euid is None else euid
        #: What is planned, for whom (the daemon's PID, this reaper's uid and right to signal
        #: other users' processes): the planner keeps them.
        self.planner = Planner(config, daemon_pid, uid,
                               may_signal_other_users() if may_signal_others is None
                               else may_signal_others)
        self._signals = signaller or Signaller()
        self.audit = AuditWriter(audit_path, actor, uid, clock)
        #: Why a dry run's plan is not in the audit log (None: it is, or nothing was planned).
        self.unrecorded: Optional[str] = None

    # -- planning ------------------------------------------------------------------------------
    def plan(self, report: NodeReport, filters: Filters = _EVERY, dry_run: bool = False,
             grace: Optional[float] = None) -> list[Action]:
        """`grace` (default: the config's) is only what the plan says; execute() takes its own
        (Planner.plan).

        A dry run's plan goes to the audit log here; any other plan when execute() carries it
        out (a plan that is shown and declined was never more than a dry run)."""
        actions = self.planner.plan(report, filters, grace)
        if dry_run:
            # A dry run changes nothing, so it is not refused for want of the right to record
            # it: a reader of the state directory (the gpuwatch group) may plan; `unrecorded`
            # says why the plan is not on record.
            try:
                self.audit.write([self.audit.entry(Result(a, ReapOutcome.PLANNED), PLANNED,
                                                   dry_run=True) for a in actions])
            except PermissionError as exc:
                self.unrecorded = audit_refusal(self.audit_path, exc)
        return actions

    def spared(self, report: NodeReport, filters: Filters) -> list[Spared]:
        """The protected GPU holders `filters` name by --job or --pid (Planner.spared)."""
        return self.planner.spared(report, filters)

    def check_audit_writable(self) -> None:
        """Raise AuditRefused when the audit log cannot be appended to: a reap is recorded
        before its first signal, so one that cannot be recorded must not start."""
        try:
            self.audit.touch()
        except OSError as exc:
            raise AuditRefused(audit_refusal(self.audit_path, exc)) from None

    def audit_planned(self, actions: Iterable[Action]) -> None:
        """Record plans that are not carried out (the daemon's refused auto-reaps)."""
        self.audit.write([self.audit.entry(Result(a, ReapOutcome.PLANNED), PLANNED)
                          for a in actions])

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
        batch = os.urandom(6).hex()
        ids = [f"{batch}.{i}" for i in range(len(actions))]
        self.audit.write([self.audit.entry(Result(a, ReapOutcome.PLANNED), PLANNED,
                                           action_id=ids[i]) for i, a in enumerate(actions)])
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
                done(i, Result(a, ReapOutcome.REFUSED, a.refused or ""))
            elif a.action == REFUSE_SERVICE:
                done(i, Result(a, REFUSED_SERVICE, a.refused or ""))
            elif a.action == REPORT:
                done(i, Result(a, ReapOutcome.UNKILLABLE if a.kind == Kind.UNKILLABLE
                               else ReapOutcome.FAILED, a.refused or ""))
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
                                       veto=self.planner.veto(actions[i])))
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
            return Result(a, ReapOutcome.REAPED, "its parent reaped it")
        parent = ProcessRef(a.target, a.target_start_time)
        told = False
        sent: tuple[tuple[str, float], ...] = ()
        if a.target != 1:
            try:
                told = self._signals.send(parent, signal.SIGCHLD) == SAME
            except OSError as exc:
                return Result(a, ReapOutcome.FAILED, f"cannot signal its parent: {exc.strerror}")
            if told:
                sent = (("SIGCHLD", time.time()),)
                if not self._signals.wait_collected(zombie, WAITING):
                    signalled(Result(a, ReapOutcome.WAITING, "SIGCHLD sent to its parent", sent))
        if self._signals.wait_collected(zombie, SETTLE):
            return Result(a, ReapOutcome.REAPED, "reaped after its parent was told (SIGCHLD)"
                          if told else "reaped by its new parent", sent)
        return Result(a, ReapOutcome.FAILED, f"its parent {a.target} does not reap it: end the "
                                             "parent, or wait for it to exit", sent)
