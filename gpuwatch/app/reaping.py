"""Reaping, wired once: plan -> confirm -> execute -> NVML check -> audit.

`gpuwatch reap`, `gpuwatch top` and the daemon's auto-reap reap through `Reap`: the same
Reaper (gpuwatch.actions.reaper, planning with gpuwatch.actions.reap_plan: the filters, the
safety checks; the one signalling path), the same audit log (gpuwatch.actions.reap_audit:
reap.jsonl in the state directory, written by the Reaper as it plans and acts)
and, where the caller asks what the next job would find, the same NVML check afterwards
(gpuwatch.actions.release). Confirmation is the caller's: a prompt (`reap`), a dialog (`top`) or
a policy (`DaemonReaping`, below: only the configured kinds, findings open long enough, a rate
limit, a refusal recorded once).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from gpuwatch.actions.reap_audit import AUDIT_NAME, AuditFollower, AuditWriter
from gpuwatch.actions.reap_plan import TERMINATE, VIA_PARENT, Action, Filters, Result, Spared
from gpuwatch.actions.reaper import Reaper
from gpuwatch.config import Config
from gpuwatch.forwarded import Forwarded
from gpuwatch.model import NodeReport
from gpuwatch.threads import start_without_signals
from gpuwatch.units import plural

# The daemon's reaping logs as the daemon always has: its lines keep their logger's name.
log = logging.getLogger("gpuwatch.daemon")

#: A row of a reap's view: the action, its result ("planned" in a plan) and the detail.
Row = tuple[Action, str, str]


@dataclass(frozen=True)
class Done:
    """What carrying out a plan did."""

    results: list[Result]
    #: Each result as the reap views show it, with what NVML said of its memory afterwards.
    rows: list[Row]
    #: The PIDs of the plan whose GPU memory is still held (empty when not checked).
    held: list[int]


class Reap:
    """One reaper's plans and their carrying out, audited; `actor` names it in the audit log
    ("cli" for `reap` and `top`, "daemon" for the auto-reap)."""

    def __init__(self, cfg: Config, daemon_pid: Optional[int] = None,
                 actor: str = "cli") -> None:
        self.cfg = cfg
        self.reaper = Reaper(cfg, cfg.daemon.state_dir / AUDIT_NAME, daemon_pid=daemon_pid,
                             actor=actor)

    audit_path = Forwarded[Path]("reaper")
    #: Why a dry run's plan could not be recorded (None: it was, or none was made).
    unrecorded = Forwarded[Optional[str]]("reaper")

    def spared(self, report: NodeReport, filters: Filters) -> list[Spared]:
        """The protected GPU holders `filters` name by --job or --pid: never signalled, their
        memory stays held (Reaper.spared)."""
        return self.reaper.spared(report, filters)

    def check_audit_writable(self) -> None:
        """Raises AuditRefused when a plan carried out could not be recorded: checked before
        anyone is asked to confirm, and before anything is signalled."""
        self.reaper.check_audit_writable()

    def plan(self, report: NodeReport, filters: Filters, dry_run: bool = False,
             grace: Optional[float] = None) -> list[Action]:
        """The actions for `report`'s findings that `filters` select (a dry run's plan is
        audited here, where it may be; any other when it is carried out). Raises OSError when
        the audit log cannot be written."""
        return self.reaper.plan(report, filters, dry_run=dry_run, grace=grace)

    def carry_out(self, actions: Iterable[Action], grace: Optional[float] = None,
                  on_result: Optional[Callable[[Result], None]] = None,
                  check_release: bool = True) -> Done:
        """Carry out a confirmed plan; then, with `check_release`, read NVML until the memory
        of the processes that ended is released (or RELEASE_WAIT passed)."""
        results = self.reaper.execute(actions, grace=grace, on_result=on_result)
        if not check_release:
            return Done(results, [(r.action, r.result, r.detail) for r in results], [])
        from gpuwatch.actions.release import holders, nvml_after, still_held

        reading = nvml_after({r.action.pid for r in results if r.freed and r.action.pid})
        listed = holders(reading) if reading.status.available else None
        held = still_held(results, reading)
        return Done(results, [(r.action, r.result, r.detail + _released(r, listed))
                              for r in results], held)

    def audit_planned(self, actions: Iterable[Action]) -> None:
        """Record plans that are not carried out (the auto-reap's refusals)."""
        self.reaper.audit_planned(actions)


def _released(r: Result, still_held: Optional[set[int]]) -> str:
    if not r.freed or r.action.gpu_memory_bytes is None or still_held is None:
        return ""
    if r.action.pid in still_held:
        return "; the driver still lists its GPU memory"
    return "; GPU memory released"


class DaemonReaping:
    """The daemon's side of reaping: it follows the audit log, whoever writes it (counting the
    results into `count(kind, result, n)`, recording what became of actions a stopped reaper
    left without a result), and, with reaper.auto, carries out its own reaps by policy."""

    def __init__(self, config: Config, count: Callable[[str, str, int], None]) -> None:
        self.config = config
        self._count = count
        self._audit: Optional[AuditFollower] = None
        self._auto_reaps: deque[float] = deque()
        self._reaping: Optional[threading.Thread] = None

    def after_poll(self, report: NodeReport) -> None:
        """What each poll brings: the audit log's news, then (reaper.auto) the auto-reap."""
        self.count_reaps()
        if self.config.reaper.auto:
            self.auto_reap(report)

    def count_reaps(self) -> None:
        """Reaps in the audit log since the daemon started, whoever carried them out; and what
        became of actions a reaper left without a result (a reaper killed in its grace period,
        this daemon's own before a restart), recorded as "recovered" lines."""
        if self._audit is None:  # counts from now: earlier lines belong to earlier runs
            path = self.config.daemon.state_dir / AUDIT_NAME
            self._audit = AuditFollower(path, AuditWriter(path, "daemon", os.geteuid()))
        news = self._audit.poll()
        if news.ended_torn:
            log.warning("%s ended in a torn line (a reaper stopped in the middle of writing it): "
                        "the next entry starts on a new line", self._audit.path)
        if news.torn:
            log.warning("%s: %s skipped", self._audit.path, plural(news.torn, "torn line"))
        for entry in news.recovered:
            log.warning("reap audit: %s %s (%s) was left without a result: %s: %s",
                        entry["kind"], entry["pid"], entry["name"], entry["result"],
                        entry["detail"])
        if news.error is not None:
            log.warning("reap audit: %s", news.error)
        for (kind, result), n in news.counts.items():
            self._count(kind, result, n)

    def auto_reap(self, report: NodeReport) -> None:
        """The daemon's own reaping: only the configured kinds, only findings open long enough,
        at a bounded rate, one batch at a time, with every check the CLI makes. A plan it
        refuses is recorded once per process and reason, not at every poll."""
        if self._reaping is not None:
            if self._reaping.is_alive():
                return
            # Its last results may have been written since the log was read this poll.
            self._reaping = None
            self.count_reaps()
        policy = self.config.reaper
        now = time.monotonic()
        while self._auto_reaps and now - self._auto_reaps[0] > 60:
            self._auto_reaps.popleft()
        budget = policy.auto_max_per_minute - len(self._auto_reaps)
        if budget <= 0:
            return
        reap = Reap(self.config, daemon_pid=os.getpid(), actor="daemon")
        filters = Filters(kinds=frozenset(policy.auto_kinds), older_than=policy.auto_after)
        planned = reap.plan(report, filters)
        actions = [a for a in planned if a.action in (TERMINATE, VIA_PARENT)]
        if self._audit is not None:
            actions = self._audit.not_ended_yet(actions)
            refused = self._audit.refusals_to_audit(
                [a for a in planned if a.action not in (TERMINATE, VIA_PARENT)])
            try:
                reap.audit_planned(refused)
            except OSError as exc:
                log.warning("auto-reap: cannot write the audit log: %s", exc)
            for a in refused:
                log.warning("auto-reap: %s %s (%s) refused: %s", a.kind, a.pid, a.name,
                            a.refused)
        if not actions:
            return
        actions = actions[:budget]
        self._auto_reaps.extend([now] * len(actions))

        def logged(r: Result) -> None:
            log.warning("auto-reap: %s %s (%s): %s %s", r.action.kind, r.action.pid,
                        r.action.name, r.result, r.detail)

        def run() -> None:
            try:
                reap.carry_out(actions, on_result=logged, check_release=False)
            except OSError as exc:
                log.error("auto-reap: cannot write the audit log: %s", exc)

        self._reaping = threading.Thread(target=run, name="auto-reap", daemon=True)
        start_without_signals(self._reaping)
