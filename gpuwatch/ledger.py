"""The findings ledger: which findings were open at the last poll, since when, and the reason
and summary each was first given (a finding's words do not change under the people and alerts
that saw them)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Optional

from gpuwatch.evidence import HungAtExit, LeakEvidence
from gpuwatch.model import Finding, FindingIdentity, HostProcess, Job, Kind


class FindingsLedger:
    """The findings open at the last poll, by identity (Finding.identity)."""

    def __init__(self) -> None:
        # Identity -> (first seen, reason, summary, whether the reason may still take a culprit).
        self._open: dict[FindingIdentity, tuple[float, str, str, bool]] = {}

    def processes(self) -> set[tuple[Optional[int], Optional[float]]]:
        """The processes (PID, start time) that have an open finding."""
        return {(identity[1], identity[2]) for identity in self._open}

    def open_since(self, identity: FindingIdentity) -> Optional[float]:
        """When the finding with this identity (Finding.identity) opened, if it was open at the
        last poll."""
        kept = self._open.get(identity)
        return kept[0] if kept is not None else None

    def stamp(self, findings: Iterable[Finding], processes: Mapping[int, HostProcess],
              now: float, job_label: Callable[[HostProcess], Optional[Job]] = lambda p: p.job
              ) -> list[Finding]:
        """Give each finding the time it was first seen, the reason it was first given and its
        job (`job_label`: History.job_label, by default the process's own); forget findings
        that closed.

        A reason is the evidence when the finding opened ("exited before 10:00:00Z (not reaped
        yet)"); the same process may be described otherwise a poll later (its launcher reaped,
        a leak's culprit named by another means), but what people and alerts saw must not
        change under them. Figures that move belong in `details`.

        One exception: a leak that opened without a culprit takes the reason of the first poll
        that names one (a culprit in its LeakEvidence), and keeps that one. Naming the culprit is
        what the daemon works towards after the leak opened (a discovery pass, a trace it asked
        for), so "RSS grows every step" would otherwise stay the reason for the whole life of a leak
        whose cause became known minutes later. The reason changes at most once, from saying
        less to saying more; a culprit named differently later only shows in `details`. So
        does a step stall's, once the process reports hung at exit (HungAtExit):
        what holds it is then known. The summary (the same evidence from identity and figures)
        is kept and refined with the reason, so the two always say the same.
        """
        stamped = []
        open_now: dict[FindingIdentity, tuple[float, str, str, bool]] = {}
        for f in findings:
            kept = self._open.get(f.identity)
            if kept is None:
                since, reason, summary = now, f.reason, f.summary
                refinable = ((f.kind == Kind.LEAK and not _names_culprit(f))
                             or (f.kind == Kind.STALLED and not _hung_at_exit(f)))
            else:
                since, reason, summary, refinable = kept
                if refinable and (_names_culprit(f) or _hung_at_exit(f)):
                    reason, summary, refinable = f.reason, f.summary, False
            open_now[f.identity] = (since, reason, summary, refinable)
            job = f.job
            p = processes.get(f.pid) if f.pid is not None else None
            if job is None and p is not None and p.identity == (f.pid, f.start_time):
                job = job_label(p)
            stamped.append(replace(f, since=since, reason=reason, summary=summary, job=job))
        self._open = open_now
        return stamped


def _names_culprit(f: Finding) -> bool:
    return isinstance(f.details, LeakEvidence) and f.details.culprit is not None


def _hung_at_exit(f: Finding) -> bool:
    return isinstance(f.details, HungAtExit)
