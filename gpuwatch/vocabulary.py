"""The words gpuwatch's parts pass each other: finding kinds, severities, process states, how a
leak's culprit was found, which figure grows, what became of a trace, what a reap ended in, what
a check of `gpuwatch doctor` found, and what a memory limit is.

Each is a `str` enumeration: a member is its value everywhere it leaves the program (the JSON
document, the metrics' label values, the audit log, the command line's options) and compares
equal to it, so a document written before a word became a member reads the same. Members are
written as their value (`f"{Severity.CRITICAL}"` is "critical"), on every Python gpuwatch runs
on (3.9 and later: `enum.StrEnum` is 3.11's).
"""

from __future__ import annotations

from enum import Enum
from typing import Optional, TypeVar

W = TypeVar("W", bound="Word")


class Word(str, Enum):
    """A `str` enumeration written as its value (the base of every enumeration here)."""

    # Its value, not "Kind.ORPHAN", wherever it is written: f-strings, metric labels, str().
    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]

    @classmethod
    def parse(cls: type[W], text: object) -> Optional[W]:
        """The member whose value is `text`; None for anything else (a word of a later
        version, a value a document left out)."""
        try:
            return cls(text)
        except ValueError:
            return None


class Kind(Word):
    """What a finding says is wrong: the one list of finding kinds (docs/findings.md)."""

    ORPHAN = "orphan"
    ZOMBIE = "zombie"
    LEFTOVER = "leftover"
    GHOST = "ghost"
    LEAK = "leak"
    STALLED = "stalled"
    UNKILLABLE = "unkillable"
    UNALLOCATED = "unallocated"


#: Every kind, in the order metrics and `reap --kind`'s message list them.
KINDS: tuple[Kind, ...] = tuple(Kind)
#: What a reap may act on by default: unkillable and ghost findings can only be reported (signals
#: cannot end the one; there is no process to signal for the other), leaks and stalls are a
#: person's call.
REAPABLE_KINDS: frozenset[Kind] = frozenset({Kind.ORPHAN, Kind.LEFTOVER, Kind.ZOMBIE})


class Severity(Word):
    """How urgent a finding is (docs/findings.md), most urgent first."""

    CRITICAL = "critical"
    WARNING = "warning"
    INFO = "info"

    @property
    def rank(self) -> int:
        """0 for the most urgent: findings are listed in this order."""
        return _SEVERITY_RANK[self]


_SEVERITY_RANK = {s: i for i, s in enumerate(Severity)}


def severity_rank(severity: object) -> int:
    """Severity.rank of `severity`, and after every severity for a word that is none."""
    known = Severity.parse(severity)
    return known.rank if known is not None else len(_SEVERITY_RANK)


class ProcState(Word):
    """A process's state, from the letter of /proc/PID/stat, named as psutil names it."""

    RUNNING = "running"
    SLEEPING = "sleeping"
    DISK_SLEEP = "disk-sleep"  # uninterruptible: signals wait until it wakes
    STOPPED = "stopped"
    TRACING_STOP = "tracing-stop"
    ZOMBIE = "zombie"  # exited; its parent has yet to collect it
    DEAD = "dead"
    WAKE_KILL = "wake-kill"
    WAKING = "waking"
    PARKED = "parked"
    IDLE = "idle"

    @property
    def ended(self) -> bool:
        """The process has exited: a zombie or dead, whatever its parent does about it."""
        return self in (ProcState.ZOMBIE, ProcState.DEAD)


class FoundBy(Word):
    """How a leak's culprit was found (docs/findings.md)."""

    #: A buffer given to agent.watch() explains the growth.
    WATCHED = "watched"
    #: A container the agent's own discovery named explains it.
    DISCOVERED = "discovered"
    #: A tensor the agent's discovery found holding the autograd history of every step.
    AUTOGRAD = "autograd"
    #: The top allocation site of a trace explains it (its name is a `file:line`).
    TRACED = "traced"


class Series(Word):
    """The figure a leak finding says grows. A watched buffer's is written with its name:
    "buffer `fetch_buffer`" (gpuwatch.evidence.LeakEvidence.series_text)."""

    RSS = "RSS"
    GPU_MEMORY = "GPU memory"
    #: Private memory of forked workers (copy-on-write).
    USS = "USS"
    BUFFER = "buffer"
    #: The autograd graph a tensor holds, in nodes: it grows every step whatever the bytes.
    AUTOGRAD = "autograd history"


class GrowthUnit(Word):
    """What a leak's growth is measured against: training steps (an instrumented process) or
    seconds (any other)."""

    STEP = "step"
    SECOND = "second"


class TraceStatus(Word):
    """What became of an allocation trace asked of a leaking process (docs/agent-protocol.md)."""

    REQUESTED = "requested"  # asked, no answer yet
    DONE = "done"
    REFUSED = "refused"
    FAILED = "failed"


class LimitSource(Word):
    """What a leak runs out against: a configured host-memory limit, the process's cgroup
    memory.max, the node's MemAvailable, or its GPU's free memory. A reason says it as it is:
    "runs out against the cgroup limit"."""

    CONFIGURED = "configured"
    CGROUP = "cgroup"
    NODE = "node"
    GPU = "GPU"


class ReapOutcome(Word):
    """What an action of a reap ended in (the `outcome` label of gpuwatch_reaped_total, the audit
    log's `result`)."""

    #: A dry run's, and an action's before it is carried out.
    PLANNED = "planned"
    #: Not an end: signalled, and given time to go (the audit log says so before the outcome).
    WAITING = "waiting"
    EXITED = "exited"
    KILLED = "killed"
    REAPED = "reaped"
    GONE = "gone"
    IDENTITY_CHANGED = "identity-changed"
    REFUSED = "refused"
    REFUSED_SERVICE = "refused-service"
    UNKILLABLE = "unkillable"
    STILL_RUNNING = "still-running"
    FAILED = "failed"


#: What carrying out an action can end in: every outcome but the two that are no end.
FINAL_OUTCOMES: tuple[ReapOutcome, ...] = tuple(
    o for o in ReapOutcome if o not in (ReapOutcome.PLANNED, ReapOutcome.WAITING))
#: The outcomes after which the process no longer holds anything.
FREED_OUTCOMES: frozenset[ReapOutcome] = frozenset(
    {ReapOutcome.EXITED, ReapOutcome.KILLED, ReapOutcome.REAPED, ReapOutcome.GONE})


class CheckStatus(Word):
    """What a check of `gpuwatch doctor` found."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    #: The check does not apply here (systemd not running) or cannot tell; never a problem.
    SKIP = "skip"
