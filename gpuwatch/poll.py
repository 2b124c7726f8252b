"""One poll: read every source once and join the parts into one immutable `NodeSnapshot`.

Which host processes are read: the GPU holders NVML lists (without NVML, what looks like GPU
work), the processes that report through the agent, the members of their jobs (every descendant
of each job root), the processes the caller asks to keep watching (job members from earlier
polls, so helpers stay visible after they are reparented), and the ancestors of all of these up
to PID 1. Besides, for each `gpuwatch run` supervisor these processes name, whether it still runs.

A GPU whose process lists cannot be read keeps the holders of its last good read, with unknown
figures (gpuwatch.sources.nvml): those that have left /proc since are dropped here, except PIDs
that were already absent from /proc while NVML still listed them (ghosts stay ghosts).
"""

from __future__ import annotations

import socket
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import NamedTuple, Optional, Protocol

from gpuwatch.clock import SteadyClock
from gpuwatch.frozen import evolve
from gpuwatch.jobtree import job_root, job_roots
from gpuwatch.launch_env import run_supervisor
from gpuwatch.model import (
    AgentReading,
    GpuDevice,
    GpuProcessUsage,
    HostProcess,
    NodeSnapshot,
    ProcessReading,
    SourceError,
)
from gpuwatch.sources.memory import CgroupMemory, read_mem_available
from gpuwatch.sources.nvml import NvmlSource
from gpuwatch.sources.private_memory import PrivateMemorySource
from gpuwatch.sources.processes import ProcessSource


class AgentSource(Protocol):
    def drain(self) -> dict[int, AgentReading]: ...

    def forget(self, pids: Iterable[int]) -> None: ...

#: Bounds the walk down job trees, so a fork bomb under a launcher cannot stall a poll.
MAX_JOB_MEMBERS = 4096
#: New PIDs looked at, at least, to find the children job trees gained since the last walk (as
#: many as the trees hold members, if more); beyond that many processes started between two
#: polls the trees are walked again.
MAX_NEW_PIDS = 64
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
    #: New PIDs that /proc did not have yet when last looked at (a fork not yet complete),
    #: looked at once more.
    unseen: frozenset[int]
    polls: int


class Poller:
    def __init__(self, nvml: Optional[NvmlSource] = None,
                 processes: Optional[ProcessSource] = None,
                 hostname: Optional[str] = None,
                 clock: Optional[SteadyClock] = None,
                 agents: Optional[AgentSource] = None,
                 private_memory: Optional[PrivateMemorySource] = None) -> None:
        self.nvml = nvml or NvmlSource()
        self.processes = processes or ProcessSource()
        #: USS and PSS of the job trees' members (the daemon reads each at most once per
        #: history sample: gpuwatch.config.sample_spacing).
        self.private_memory = private_memory or PrivateMemorySource()
        self.agents = agents
        self.cgroup_memory = CgroupMemory()
        self.hostname = hostname or socket.gethostname()
        #: Every time in a snapshot is on this clock (gpuwatch.clock): the agent receiver that
        #: feeds this poller must stamp its reports on the same one.
        self.clock = clock or SteadyClock()
        #: PIDs NVML listed at the last poll that /proc did not have.
        self._unlisted: set[int] = set()
        self._walk: Optional[_Walk] = None

    @property
    def truncated(self) -> Mapping[str, int]:
        """The texts the process source cut at the read so far, by what
        (gpuwatch_text_truncated_total)."""
        return self.processes.truncated

    def poll(self, watch: Iterable[int] = ()) -> NodeSnapshot:
        started = time.perf_counter()
        taken_at = self.clock()
        reading = self.nvml.read()
        # (An NVML stand-in without `carried` never carries holders over.)
        gpus = self._without_exited(reading.gpus, getattr(self.nvml, "carried", {}))
        usage: dict[int, list[GpuProcessUsage]] = defaultdict(list)
        for gpu in gpus:
            for u in gpu.processes:
                usage[u.pid].append(u)
        gpu_usage = {pid: tuple(us) for pid, us in usage.items()}
        # Without NVML nobody can say who holds GPU memory; show what looks like GPU work.
        seeds = (set(usage) if reading.status.available
                 else self.processes.discover_gpu_candidates())
        agents = self.agents.drain() if self.agents is not None else {}
        seeds |= agents.keys()
        host = self.processes.read(seeds | set(watch), gpu_usage)
        roots = {job_root(pid, host.processes) for pid in seeds}
        more = self._read_members(frozenset(root for root in roots if root is not None),
                                  gpu_usage, host.processes)
        processes = more.processes
        self.processes.forget_others(processes.values())
        processes, private_errors = self._with_private_memory(
            processes, {root for root in roots if root is not None} | set(watch), taken_at)
        agents = self._live_agents(agents, processes)
        limited = {p.cgroup for pid, p in processes.items()
                   if p.cgroup and (p.holds_gpu or pid in agents)}
        self._unlisted = {pid for pid, p in processes.items() if p.holds_gpu and not p.in_procfs}
        return NodeSnapshot(
            taken_at=taken_at,
            clock_step=self.clock.step(),
            hostname=self.hostname,
            nvml=reading.status,
            gpus=gpus,
            processes=processes,
            errors=reading.errors + host.errors + more.errors + private_errors,
            poll_duration_seconds=time.perf_counter() - started,
            job_roots=MappingProxyType(job_roots(processes)),
            agents=MappingProxyType(agents),
            mem_available_bytes=read_mem_available(),
            cgroup_memory=MappingProxyType(self.cgroup_memory.read(limited)),
            run_supervisors=MappingProxyType(self._run_supervisors(processes)),
            observer_pid=self._observer_pid(),
        )

    def _observer_pid(self) -> Optional[int]:
        """This process's PID as the process source's /proc shows it (a stand-in source
        without `own_pid` knows none)."""
        own_pid = getattr(self.processes, "own_pid", None)
        return own_pid() if own_pid is not None else None

    def _with_private_memory(self, processes: Mapping[int, HostProcess], roots: set[int],
                             now: float
                             ) -> tuple[Mapping[int, HostProcess], tuple[SourceError, ...]]:
        """`processes` with the USS and PSS of the job trees' forked workers: members (under
        the roots, or asked to be watched) that hold no GPU memory and run what their parent
        runs (forked without an exec, as a DataLoader's workers are), where copy-on-write can
        grow the node's memory behind a flat RSS. Not the trainers, whose private memory
        decides nothing RSS does not, and whose page tables are the largest to walk."""
        children: dict[int, list[int]] = defaultdict(list)
        for pid, p in processes.items():
            if p.ppid:
                children[p.ppid].append(pid)
        members: list[HostProcess] = []
        todo, seen = sorted(roots & processes.keys()), set(roots)
        while todo:
            pid = todo.pop()
            p = processes[pid]
            parent = processes.get(p.ppid) if p.ppid else None
            if (parent is not None and not p.holds_gpu and p.cmdline
                    and p.cmdline == parent.cmdline):
                members.append(p)
            for child in children.get(pid, ()):
                if child not in seen:
                    seen.add(child)
                    todo.append(child)
        found, errors = self.private_memory.read(members, now)
        if not found:
            return processes, tuple(errors)
        with_private = dict(processes)
        for pid, figures in found.items():
            with_private[pid] = evolve(processes[pid], uss_bytes=figures.uss_bytes,
                                       pss_bytes=figures.pss_bytes)
        return MappingProxyType(with_private), tuple(errors)

    def _without_exited(self, gpus: tuple[GpuDevice, ...],
                        carried: Mapping[int, frozenset[int]]) -> tuple[GpuDevice, ...]:
        """`gpus` without the holders carried over from an earlier read (their GPU's process
        list could not be read) whose process has exited since: gone from /proc, or a zombie
        with no thread left (the driver frees an exited process's memory; a zombie whose other
        threads live on keeps it). Nothing says they still hold memory, and kept they would read
        as ghosts."""
        gone: set[int] = set()
        for pid in set().union(*carried.values()) - self._unlisted:
            try:
                stat = self.processes.stat(pid)
            except (OSError, ValueError, IndexError):
                continue  # unreadable: kept, unknown
            if stat is None or (stat.state == "zombie" and stat.threads <= 1):
                gone.add(pid)
        if not gone:
            return gpus
        return tuple(
            replace(g, processes=tuple(u for u in g.processes
                                       if not (u.pid in gone and u.pid in carried[g.index])))
            if g.index in carried else g
            for g in gpus)

    def _run_supervisors(self, processes: Mapping[int, HostProcess]
                         ) -> dict[int, Optional[float]]:
        """What runs now on each PID named as a `gpuwatch run` supervisor by a process read.

        A live supervisor is an ancestor of its job's processes, so it has been read already;
        /proc/PID/stat is read only for the PIDs of supervisors that are gone (or live outside
        the tree), one line each.
        """
        named = {ref.pid for p in processes.values()
                 if (ref := run_supervisor(p.launch_env)) is not None}
        found: dict[int, Optional[float]] = {}
        for pid in named:
            known = processes.get(pid)
            if known is not None:
                if not known.in_procfs or known.state == "zombie":
                    found[pid] = None
                elif known.start_time is not None:
                    found[pid] = known.start_time
                continue
            try:
                stat = self.processes.stat(pid)
            except (OSError, ValueError, IndexError):
                continue  # unreadable: left out, so no detector concludes it is gone
            found[pid] = stat.start_time if stat is not None and stat.state != "zombie" else None
        return found

    def _live_agents(self, agents: dict[int, AgentReading],
                     processes: Mapping[int, HostProcess]) -> dict[int, AgentReading]:
        """Agents whose process still runs; the others are forgotten by the receiver.

        A process that started after an agent's first report, or that is another user's than
        the reports' (the kernel's UID of each), cannot have sent them: its PID was reused, and
        the reports belong to the process that exited. (The start time is compared to the
        second; a PID reused within it, easy where pid_max is 32768, is told by its user.)
        """
        gone = [pid for pid, a in agents.items()
                if (p := processes.get(pid)) is None or not p.in_procfs or p.state == "zombie"
                or (p.start_time is not None and p.start_time > a.first_seen + 1)
                or (p.uid is not None and p.uid != a.uid)]
        if gone and self.agents is not None:
            self.agents.forget(gone)
        return {pid: a for pid, a in agents.items() if pid not in gone}

    def _read_members(self, roots: frozenset[int],
                      gpu_usage: Mapping[int, tuple[GpuProcessUsage, ...]],
                      known: Mapping[int, HostProcess]) -> ProcessReading:
        """Read every process under the roots, with what `known` holds already.

        Walking the trees reads a children file per member, a third of a poll on a node of
        dataloader workers, and most polls find the trees as they were. So the last walk's
        members are read again, with the processes started since whose parent is in a tree
        (PIDs are handed out in order; /proc/loadavg names the last), and the members are
        worked out again from each one's parent as read: a member that exited, or was
        reparented out of its tree, leaves it; a child forked since joins it. Each new PID
        costs one stat line, about what a member costs a walk, so the trees are walked again
        when more processes started than they hold, when a record cannot say who its parent
        is, when the roots change, and every WALK_EVERY polls whatever the evidence says.
        """
        last = self._walk
        last_pid = self.processes.last_pid()
        if (last is not None and last_pid is not None and last.roots == roots
                and last.polls < WALK_EVERY):
            forks = self._forks_since(last, last_pid)
            if forks is not None:
                born, unseen = forks
                candidates = last.members | born if born else last.members
                reading = self.processes.read(candidates - known.keys(), gpu_usage, known=known)
                members = self._members_now(last, born, reading.processes)
                if members is last.members:  # most polls: the trees as they were
                    self._walk = last._replace(last_pid=last_pid, unseen=unseen,
                                               polls=last.polls + 1)
                    return reading
                if members is not None and len(members) <= MAX_JOB_MEMBERS:
                    self._walk = _Walk(roots, members, last_pid,
                                       self._shape(roots | members, reading.processes),
                                       unseen, last.polls + 1)
                    return self._without(reading, candidates - members - known.keys())
                # Read again from the new walk, as if this read had not been.
        members = self._descendants(roots)
        reading = self.processes.read(members - known.keys(), gpu_usage, known=known)
        self._walk = None if last_pid is None else _Walk(
            roots, members, max(0, last_pid - WALK_SLACK),
            self._shape(roots | members, reading.processes), frozenset(), 0)
        return reading

    def _forks_since(self, walk: _Walk, last_pid: int
                     ) -> Optional[tuple[set[int], frozenset[int]]]:
        """The processes started since `walk` whose parent is in a tree (children of members,
        their children in turn), and the PIDs to look at again next time; None when too many
        started to tell for less than a walk costs."""
        if last_pid < walk.last_pid:
            return None  # PIDs wrapped around
        if last_pid - walk.last_pid > max(MAX_NEW_PIDS, len(walk.members)) + WALK_SLACK:
            return None  # a busy host: a walk costs less than looking at every new PID
        tree = walk.shape.keys()
        born: set[int] = set()
        listed: dict[int, set[int]] = {}
        unseen = []
        # In order: a child's PID follows its parent's, so a new child of a new member is found
        # (the PIDs looked at again are older than the new ones).
        for pid in sorted({*range(walk.last_pid + 1, last_pid + 1), *walk.unseen}):
            if pid in tree:
                continue  # found before (a PID reused since shows in the shape)
            try:
                stat = self.processes.stat(pid)
            except (OSError, ValueError, IndexError):
                return None
            if stat is None:
                # Exited already, or not in /proc yet: a fork that is not complete. Looked at
                # once more at the next poll, by when a fork has long completed.
                if pid not in walk.unseen:
                    unseen.append(pid)
            elif stat.ppid in tree or stat.ppid in born:
                # A child as a walk finds it, in its parent's children file: not a thread (its
                # stat line names the process's parent too), nor a child another thread forked.
                kids = listed.get(stat.ppid)
                if kids is None:
                    kids = listed[stat.ppid] = set(self.processes.children(stat.ppid))
                if pid in kids:
                    born.add(pid)
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
                     processes: Mapping[int, HostProcess]) -> Optional[set[int]]:
        """The members among the last walk's and the processes born since, from each one's
        parent as read now; None when a root is not the process it was, or when a record
        cannot say who its parent is."""
        for root in walk.roots:
            p = processes.get(root)
            if p is None or not p.in_procfs or walk.shape.get(root) != (p.start_time, p.ppid):
                return None
        shape = walk.shape
        if not born and all(
                (p := processes.get(pid)) is not None and p.in_procfs
                and shape.get(pid) == (p.start_time, p.ppid) for pid in walk.members):
            return walk.members  # most polls: nothing changed
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
        return {pid for pid in walk.members | born if under[pid]}

    @staticmethod
    def _without(reading: ProcessReading, pids: set[int]) -> ProcessReading:
        """`reading` less processes that left the trees. Their ancestors stay: each is an
        ancestor of a root too (an orphan goes to init or to a subreaper above it)."""
        if not pids:
            return reading
        kept = {pid: p for pid, p in reading.processes.items() if pid not in pids}
        return ProcessReading(processes=MappingProxyType(kept), errors=reading.errors)

    def _descendants(self, roots: frozenset[int]) -> set[int]:
        """Every process under the roots (each root's children file read once)."""
        found: set[int] = set(roots)
        todo = list(roots)
        while todo and len(found) < MAX_JOB_MEMBERS:
            for child in self.processes.children(todo.pop()):
                if child not in found:
                    found.add(child)
                    todo.append(child)
        return found - roots

    def close(self) -> None:
        self.nvml.close()
        close = getattr(self.processes, "close", None)
        if close is not None:
            close()
