"""The members of the job trees a poll reads: every process under each job root.

Walking the trees reads a children file per member; most polls find the trees as they were, so
the walker keeps what its last walk found and looks only at the PIDs handed out since
(`JobWalker.read_members`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import NamedTuple, Optional, Protocol

from gpuwatch.model import GpuProcessUsage, HostProcess, ProcessReading


class ProcStatLine(Protocol):
    """What the walker reads of a process's stat line."""

    @property
    def ppid(self) -> int: ...


class ProcessReader(Protocol):
    """The process source as the walker uses it (gpuwatch.sources.processes.ProcessSource)."""

    def read(self, pids: Iterable[int], gpu_usage: Mapping[int, tuple[GpuProcessUsage, ...]],
             known: Optional[Mapping[int, HostProcess]] = None) -> ProcessReading: ...

    def stat(self, pid: int) -> Optional[ProcStatLine]: ...

    def children(self, pid: int) -> list[int]: ...

    def last_pid(self) -> Optional[int]: ...


#: Bounds the walk down job trees, so a fork bomb under a launcher cannot stall a poll.
MAX_JOB_MEMBERS = 4096
#: New PIDs that are live processes looked at, at least, to find the children job trees gained
#: since the last walk (as many as the trees hold members, if more); beyond that many the trees
#: are walked again, which costs a read per member.
MAX_NEW_PIDS = 64
#: A PID handed out since the last poll whose process has exited already costs a kill(pid, 0),
#: a fraction of a stat line's read: under churn (a job starting short-lived processes, hundreds
#: a second) most are, and up to this many times MAX_NEW_PIDS (or the members) of them are looked
#: at before a walk is cheaper.
DEAD_PIDS_PER_LIVE = 8
#: The job trees are walked again after this many polls whatever the evidence says: a bound on
#: how long any case the evidence misses could last.
WALK_EVERY = 64
#: PIDs before the one last handed out when a walk starts that are looked at after it: a fork
#: that had its PID but was not yet in its parent's children list when the walk read it.
WALK_SLACK = 16


class _Walk(NamedTuple):
    """The job members found by one walk of the trees under `roots`, and what would show that
    the trees have changed since."""

    roots: frozenset[int]
    members: set[int]
    #: The PID last handed out when the walk started (less WALK_SLACK), or when the trees were
    #: last found unchanged: a child forked since has a later one.
    last_pid: int
    #: Each member's and root's start time and parent: a PID reused, or a child reparented
    #: (its parent exited), shows in these.
    shape: dict[int, tuple[Optional[float], Optional[int]]]
    #: How many of the shape's processes each PID is the parent of: whether a member that
    #: exited leaves children in the trees, without a look at every member.
    parents: dict[Optional[int], int]
    #: New PIDs that /proc did not have yet when last looked at (a fork not yet complete),
    #: looked at once more.
    unseen: frozenset[int]
    polls: int


class _Trees(NamedTuple):
    """The members of the trees, their shape and its parents (as in _Walk)."""

    members: set[int]
    shape: dict[int, tuple[Optional[float], Optional[int]]]
    parents: dict[Optional[int], int]


def _parents(shape: Mapping[int, tuple[Optional[float], Optional[int]]]
             ) -> dict[Optional[int], int]:
    parents: dict[Optional[int], int] = {}
    for _, ppid in shape.values():
        parents[ppid] = parents.get(ppid, 0) + 1
    return parents


def _parent_of_others(gone: set[int], shape: Mapping[int, tuple[Optional[float], Optional[int]]],
                      parents: Mapping[Optional[int], int]) -> bool:
    """Whether a process of `gone` is the parent of one in the shape that is not gone."""
    if not any(pid in parents for pid in gone):
        return False
    among_gone: dict[Optional[int], int] = {}
    for pid in gone:
        if (was := shape.get(pid)) is not None:
            among_gone[was[1]] = among_gone.get(was[1], 0) + 1
    return any(parents.get(pid, 0) > among_gone.get(pid, 0) for pid in gone)


class JobWalker:
    """Finds the members of the job trees, poll after poll, for one process source."""

    def __init__(self, processes: ProcessReader) -> None:
        self._processes = processes
        self._last: Optional[_Walk] = None

    def read_members(self, roots: frozenset[int],
                     gpu_usage: Mapping[int, tuple[GpuProcessUsage, ...]],
                     known: Mapping[int, HostProcess]) -> ProcessReading:
        """Read every process under the roots, with what `known` holds already.

        Walking the trees reads a children file per member, a third of a poll on a node of
        dataloader workers, and most polls find the trees as they were. So the last walk's
        members are read again, with the processes started since whose parent is in a tree
        (PIDs are handed out in order; /proc/loadavg names the last), and the members are
        worked out again from each one's parent as read: a member that exited, or was
        reparented out of its tree, leaves it; a child forked since joins it. Each new PID
        costs one stat line, about what a member costs a walk (one that exited already, a
        kill(pid, 0): churn's short-lived processes), so the trees are walked again when more live
        processes started than they hold, when a record cannot say who its parent is, when the
        roots change, and every WALK_EVERY polls whatever the evidence says.
        """
        last = self._last
        last_pid = self._processes.last_pid()
        if (last is not None and last_pid is not None and last.roots == roots
                and last.polls < WALK_EVERY):
            forks = self._forks_since(last, last_pid)
            if forks is not None:
                born, unseen = forks
                candidates = last.members | born if born else last.members
                reading = self._processes.read(candidates - known.keys(), gpu_usage, known=known)
                now = self._members_now(last, born, reading.processes)
                if now is not None and now.members is last.members:  # most polls: as they were
                    self._last = last._replace(last_pid=last_pid, unseen=unseen,
                                               polls=last.polls + 1)
                    return reading
                if now is not None and len(now.members) <= MAX_JOB_MEMBERS:
                    self._last = _Walk(roots, now.members, last_pid, now.shape, now.parents,
                                       unseen, last.polls + 1)
                    return self._without(reading, candidates - now.members - known.keys())
                # Read again from the new walk, as if this read had not been.
        members = self.descendants(roots)
        reading = self._processes.read(members - known.keys(), gpu_usage, known=known)
        if last_pid is None:
            self._last = None
        else:
            shape = self._shape(roots | members, reading.processes)
            self._last = _Walk(roots, members, max(0, last_pid - WALK_SLACK), shape,
                               _parents(shape), frozenset(), 0)
        return reading

    def _forks_since(self, walk: _Walk, last_pid: int
                     ) -> Optional[tuple[set[int], frozenset[int]]]:
        """The processes started since `walk` whose parent is in a tree (children of members,
        their children in turn), and the PIDs to look at again next time; None when too many
        started to tell for less than a walk costs."""
        if last_pid < walk.last_pid:
            return None  # PIDs wrapped around
        # What a walk costs, in stat lines of live new processes: more of those, and walking is
        # cheaper. New PIDs whose process exited already (churn) cost a kill(pid, 0) each.
        budget = max(MAX_NEW_PIDS, len(walk.members))
        if last_pid - walk.last_pid > DEAD_PIDS_PER_LIVE * budget + WALK_SLACK:
            return None  # a busy host: a walk costs less than looking at every new PID
        tree = walk.shape.keys()
        # In order: a child's PID follows its parent's, so a new child of a new member is found
        # (the PIDs looked at again are older than the new ones).
        new = range(walk.last_pid + 1, last_pid + 1)
        looked = [pid for pid in (*sorted(walk.unseen), *new)
                  if pid not in tree]  # (one found before: a PID reused since shows in the shape)
        # (A stand-in source without `live` has each PID's stat line read.)
        live = getattr(self._processes, "live", None)
        born: set[int] = set()
        read: set[int] = set()
        listed: dict[int, set[int]] = {}
        for pid in looked if live is None else live(looked):
            try:
                stat = self._processes.stat(pid)
            except (OSError, ValueError, IndexError):
                return None
            if stat is None:
                continue  # exited since
            read.add(pid)
            if len(read) > budget + WALK_SLACK:
                return None  # as many live new processes as a walk reads: walk
            if stat.ppid in tree or stat.ppid in born:
                # A child as a walk finds it, in its parent's children file: not a thread (its
                # stat line names the process's parent too), nor a child another thread forked.
                kids = listed.get(stat.ppid)
                if kids is None:
                    kids = listed[stat.ppid] = set(self._processes.children(stat.ppid))
                if pid in kids:
                    born.add(pid)
        # Gone already, or, among the newest, not in /proc yet: a fork that is not complete.
        # Those are looked at once more at the next poll, by when a fork has long completed (an
        # older one had its PID before the newest forks began).
        unseen = [pid for pid in new[-WALK_SLACK:] if pid not in read and pid not in tree]
        return born, frozenset(unseen)

    @staticmethod
    def _shape(pids: Iterable[int], processes: Mapping[int, HostProcess]
               ) -> dict[int, tuple[Optional[float], Optional[int]]]:
        shape = {}
        for pid in pids:
            p = processes.get(pid)
            if p is not None and p.in_procfs:
                shape[pid] = (p.start_time, p.ppid)
        return shape

    @staticmethod
    def _members_now(walk: _Walk, born: set[int],
                     processes: Mapping[int, HostProcess]) -> Optional[_Trees]:
        """The members among the last walk's and the processes born since, from each one's
        parent as read now, and their shape (the walk's members, as they were, when nothing
        changed); None when a root is not the process it was, or when a record cannot say who
        its parent is."""
        for root in walk.roots:
            p = processes.get(root)
            if p is None or not p.in_procfs or walk.shape.get(root) != (p.start_time, p.ppid):
                return None
        shape = walk.shape
        changed = [pid for pid in walk.members
                   if not ((p := processes.get(pid)) is not None and p.in_procfs
                           and shape.get(pid) == (p.start_time, p.ppid))]
        if not changed and not born:
            return _Trees(walk.members, shape, walk.parents)  # most polls: nothing changed
        gone = {pid for pid in changed
                if (p := processes.get(pid)) is None or not p.in_procfs}
        alive = {pid: p for pid in born
                 if (p := processes.get(pid)) is not None and p.in_procfs}
        if (len(gone) == len(changed) and gone.isdisjoint(p.ppid for p in alive.values())
                and all(p.ppid is not None for p in alive.values())
                and not _parent_of_others(gone, shape, walk.parents)):
            # Under churn, most polls: processes born under the trees since (each found in its
            # parent's children file) and members gone with no member under them: no parent
            # to follow. The shape changes by as much.
            now = dict(shape)
            parents = dict(walk.parents)
            for pid in gone:
                was = now.pop(pid, None)  # (none for a member unreadable at the walk)
                if was is not None:
                    parents[was[1]] -= 1
            for pid, p in alive.items():
                now[pid] = (p.start_time, p.ppid)
                parents[p.ppid] = parents.get(p.ppid, 0) + 1
            return _Trees((walk.members - gone) | alive.keys(), now,
                          {ppid: n for ppid, n in parents.items() if n})
        # Whether each process is under a root, worked out once per process.
        under: dict[int, bool] = dict.fromkeys(walk.roots, True)
        for pid in walk.members | born:
            chain = []
            while pid not in under:
                p = processes.get(pid)
                if p is None or not p.in_procfs:
                    under[pid] = False  # exited: out of the trees, its children reparented
                    break
                was = shape.get(pid)
                if p.ppid is None or (was is not None and was[0] != p.start_time):
                    return None  # unreadable, or a PID reused since the walk
                if pid not in born and was is None:
                    return None  # unreadable at the walk: its children were never looked at
                chain.append(pid)
                pid = p.ppid
                if pid in chain:
                    return None  # parents read at different moments disagree: walk
                if pid not in walk.members and pid not in born and pid not in walk.roots:
                    under[pid] = False  # a parent outside the trees
            verdict = under[pid]
            for link in chain:
                under[link] = verdict
        members = {pid for pid in walk.members | born if under[pid]}
        now = JobWalker._shape(walk.roots | members, processes)
        return _Trees(members, now, _parents(now))

    @staticmethod
    def _without(reading: ProcessReading, pids: set[int]) -> ProcessReading:
        """`reading` less processes that left the trees. Their ancestors stay: each is an
        ancestor of a root too (an orphan goes to init or to a subreaper above it)."""
        if pids.isdisjoint(reading.processes):  # (under churn: born, and gone by the read)
            return reading
        kept = {pid: p for pid, p in reading.processes.items() if pid not in pids}
        return ProcessReading(processes=MappingProxyType(kept), errors=reading.errors)

    def descendants(self, roots: frozenset[int]) -> set[int]:
        """Every process under the roots (each root's children file read once)."""
        found: set[int] = set(roots)
        todo = list(roots)
        while todo and len(found) < MAX_JOB_MEMBERS:
            for child in self._processes.children(todo.pop()):
                if child not in found:
                    found.add(child)
                    todo.append(child)
        return found - roots
