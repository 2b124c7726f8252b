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
from gpuwatch.jobtree import job_root, job_roots
from gpuwatch.model import (
    AgentReading,
    GpuDevice,
    GpuProcessUsage,
    HostProcess,
    NodeSnapshot,
    ProcessReading,
)
from gpuwatch.sources.jobs import run_supervisor
from gpuwatch.sources.memory import CgroupMemory, read_mem_available
from gpuwatch.sources.nvml import NvmlSource
from gpuwatch.sources.processes import ProcessSource


class AgentSource(Protocol):
    def drain(self) -> dict[int, AgentReading]: ...

    def forget(self, pids: Iterable[int]) -> None: ...

#: Bounds the walk down job trees, so a fork bomb under a launcher cannot stall a poll.
MAX_JOB_MEMBERS = 4096
#: New PIDs looked at, at most, to tell whether a job tree gained a child since the last walk;
#: beyond that many processes started between two polls the trees are walked again.
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
    #: Each member's and root's identity, parent, thread count and whether it is a zombie: a
    #: child reparented (its parent exited, or the thread that forked it did) or reaped shows
    #: in these, as a member that is gone does.
    shape: dict[int, tuple[Optional[float], Optional[int], Optional[int], bool]]
    #: New PIDs that /proc did not have yet when last looked at (a fork not yet complete),
    #: looked at once more.
    unseen: frozenset[int]
    polls: int


class Poller:
    def __init__(self, nvml: Optional[NvmlSource] = None,
                 processes: Optional[ProcessSource] = None,
                 hostname: Optional[str] = None,
                 clock: Optional[SteadyClock] = None,
                 agents: Optional[AgentSource] = None) -> None:
        self.nvml = nvml or NvmlSource()
        self.processes = processes or ProcessSource()
        self.agents = agents
        self.cgroup_memory = CgroupMemory()
        self.hostname = hostname or socket.gethostname()
        #: Every time in a snapshot is on this clock (gpuwatch.clock): the agent receiver that
        #: feeds this poller must stamp its reports on the same one.
        self.clock = clock or SteadyClock()
        #: PIDs NVML listed at the last poll that /proc did not have.
        self._unlisted: set[int] = set()
        self._walk: Optional[_Walk] = None

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
            errors=reading.errors + host.errors + more.errors,
            poll_duration_seconds=time.perf_counter() - started,
            job_roots=MappingProxyType(job_roots(processes)),
            agents=MappingProxyType(agents),
            mem_available_bytes=read_mem_available(),
            cgroup_memory=MappingProxyType(self.cgroup_memory.read(limited)),
            run_supervisors=MappingProxyType(self._run_supervisors(processes)),
        )

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

        A process that started after an agent's first report cannot have sent it: its PID was
        reused, and the reports belong to the process that exited.
        """
        gone = [pid for pid, a in agents.items()
                if (p := processes.get(pid)) is None or not p.in_procfs or p.state == "zombie"
                or (p.start_time is not None and p.start_time > a.first_seen + 1)]
        if gone and self.agents is not None:
            self.agents.forget(gone)
        return {pid: a for pid, a in agents.items() if pid not in gone}

    def _read_members(self, roots: frozenset[int],
                      gpu_usage: Mapping[int, tuple[GpuProcessUsage, ...]],
                      known: Mapping[int, HostProcess]) -> ProcessReading:
        """Read every process under the roots, with what `known` holds already.

        Walking the trees reads a children file per member, a third of a poll on a node of
        dataloader workers, and the trees rarely change. So the last walk's members are read
        again as they were, unless the trees may have changed: other roots, a member gone,
        reparented, turned zombie or with another thread count, or a process started since
        whose parent is a member (PIDs are handed out in order; /proc/loadavg names the last).
        Then, and every WALK_EVERY polls, the trees are walked again.
        """
        last = self._walk
        last_pid = self.processes.last_pid()
        if (last is not None and last_pid is not None and last.roots == roots
                and last.polls < WALK_EVERY):
            unseen = self._forks_outside(last, last_pid)
            if unseen is not None:
                reading = self.processes.read(last.members - known.keys(), gpu_usage,
                                              known=known)
                if self._same_shape(last, reading.processes):
                    self._walk = last._replace(last_pid=last_pid, unseen=unseen,
                                               polls=last.polls + 1)
                    return reading
                # Read again from the new walk, as if this read had not been: a process that
                # left the trees must not stay in the snapshot for having been read first.
        members = self._descendants(roots)
        reading = self.processes.read(members - known.keys(), gpu_usage, known=known)
        self._walk = None if last_pid is None else _Walk(
            roots, members, max(0, last_pid - WALK_SLACK),
            self._shape(roots | members, reading.processes), frozenset(), 0)
        return reading

    def _forks_outside(self, walk: _Walk, last_pid: int) -> Optional[frozenset[int]]:
        """The PIDs to look at again next time when no process started since the walk is a
        child of a member; None when one may be (or too many started to tell)."""
        if last_pid < walk.last_pid or last_pid - walk.last_pid > MAX_NEW_PIDS + WALK_SLACK:
            return None  # PIDs wrapped around, or a busy host: walk
        tree = walk.shape
        unseen = []
        for pid in (*range(walk.last_pid + 1, last_pid + 1), *walk.unseen):
            if pid in tree:
                continue  # found by the walk (a PID reused since shows in the shape)
            try:
                stat = self.processes.stat(pid)
            except (OSError, ValueError, IndexError):
                return None
            if stat is None:
                # Exited already, or not in /proc yet: a fork that is not complete. Looked at
                # once more at the next poll, by when a fork has long completed.
                if pid not in walk.unseen:
                    unseen.append(pid)
            elif stat.ppid in tree:
                return None  # a member's new child (or a thread of a member's child)
        return frozenset(unseen)

    @staticmethod
    def _shape(pids: Iterable[int], processes: Mapping[int, HostProcess]
               ) -> dict[int, tuple[Optional[float], Optional[int], Optional[int], bool]]:
        shape = {}
        for pid in pids:
            p = processes.get(pid)
            if p is not None and p.in_procfs:
                shape[pid] = (p.start_time, p.ppid, p.num_threads, p.state == "zombie")
        return shape

    def _same_shape(self, walk: _Walk, processes: Mapping[int, HostProcess]) -> bool:
        for pid, was in walk.shape.items():
            p = processes.get(pid)
            if p is None or not p.in_procfs or was != (p.start_time, p.ppid, p.num_threads,
                                                       p.state == "zombie"):
                return False
        # A member that was unreadable at the walk may be readable now, with children.
        return len(walk.shape) == len(walk.roots | walk.members)

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
