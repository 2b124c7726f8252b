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
from typing import Optional, Protocol

from gpuwatch.clock import SteadyClock
from gpuwatch.frozen import evolve
from gpuwatch.jobs.tree import job_root, job_roots
from gpuwatch.jobs.walker import JobWalker
from gpuwatch.launch_env import run_supervisor
from gpuwatch.model import (
    AgentReading,
    GpuDevice,
    GpuProcessUsage,
    HostProcess,
    Job,
    NodeSnapshot,
    Pod,
    SourceError,
)
from gpuwatch.sources.memory import CgroupMemory, NodeMemory
from gpuwatch.sources.nvml import NvmlSource
from gpuwatch.sources.private_memory import PrivateMemorySource
from gpuwatch.sources.processes import ProcessSource
from gpuwatch.vocabulary import ProcState


class PodNames(Protocol):
    def lookup(self, wanted: Mapping[str, Iterable[str]]
               ) -> tuple[Mapping[str, Pod], Mapping[str, str]]: ...


class AgentSource(Protocol):
    def drain(self) -> dict[int, AgentReading]: ...

    def forget(self, pids: Iterable[int]) -> None: ...

class Poller:
    def __init__(self, nvml: Optional[NvmlSource] = None,
                 processes: Optional[ProcessSource] = None,
                 hostname: Optional[str] = None,
                 clock: Optional[SteadyClock] = None,
                 agents: Optional[AgentSource] = None,
                 private_memory: Optional[PrivateMemorySource] = None,
                 pods: Optional[PodNames] = None) -> None:
        self.nvml = nvml or NvmlSource()
        self.processes = processes or ProcessSource()
        #: USS and PSS of the job trees' members (the daemon reads each at most once per
        #: history sample: gpuwatch.config.sample_spacing).
        self.private_memory = private_memory or PrivateMemorySource()
        self.agents = agents
        #: Kubernetes pods' names and allocations (gpuwatch.sources.pods), read without waiting.
        self.pods = pods
        #: Each named job made so far, by its id, source and names: one record, not one a poll.
        self._named_jobs: dict[tuple[str, str, str, str, Optional[str]], Job] = {}
        self.cgroup_memory = CgroupMemory()
        self.node_memory = NodeMemory()
        self.hostname = hostname or socket.gethostname()
        #: Every time in a snapshot is on this clock (gpuwatch.clock): the agent receiver that
        #: feeds this poller must stamp its reports on the same one.
        self.clock = clock or SteadyClock()
        #: PIDs NVML listed at the last poll that /proc did not have.
        self._unlisted: set[int] = set()
        #: The job trees' members, found again at each poll from what the last one found.
        self.job_walker = JobWalker(self.processes)

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
        # Each seed's root, worked out once: job_roots below starts from these.
        seed_roots = {pid: job_root(pid, host.processes) for pid in seeds}
        roots = set(seed_roots.values())
        more = self.job_walker.read_members(
            frozenset(root for root in roots if root is not None), gpu_usage, host.processes)
        processes = more.processes
        self.processes.forget_others(processes.values())
        processes, private_errors = self._with_private_memory(
            processes, {root for root in roots if root is not None} | set(watch), taken_at)
        agents = self._live_agents(agents, processes)
        named, pods = self._with_pod_names(processes)
        if named is not processes:  # a job renamed for its pod: its members' roots may move
            seed_roots, processes = {}, named
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
            job_roots=MappingProxyType(job_roots(processes, seed_roots)),
            agents=MappingProxyType(agents),
            mem_available_bytes=self.node_memory.available(),
            cgroup_memory=MappingProxyType(self.cgroup_memory.read(limited)),
            run_supervisors=MappingProxyType(self._run_supervisors(processes)),
            observer_pid=self._observer_pid(),
            pods=pods,
            gone_group_leaders=host.gone_group_leaders,
        )

    def _with_pod_names(self, processes: Mapping[int, HostProcess]
                        ) -> tuple[Mapping[int, HostProcess], Mapping[str, Pod]]:
        """`processes` whose cgroup names a pod, with its namespace, name and their container's
        name on their job, as the pod source knows them now; and those pods."""
        if self.pods is None:
            return processes, MappingProxyType({})
        wanted: dict[str, set[str]] = defaultdict(set)
        for p in processes.values():
            if p.pod_uid is not None and p.job is not None:
                if p.container_id:
                    wanted[p.pod_uid].add(p.container_id)
                else:
                    wanted.setdefault(p.pod_uid, set())
        if not wanted:
            return processes, MappingProxyType({})
        pods, containers = self.pods.lookup(wanted)
        named = dict(processes)
        jobs = self._named_jobs
        for pid, p in processes.items():
            pod = pods.get(p.pod_uid) if p.pod_uid is not None else None
            if pod is None or p.job is None:
                continue
            container = containers.get(p.container_id) if p.container_id else None
            key = (p.job.id, p.job.source, pod.namespace, pod.name, container)
            job = jobs.get(key)
            if job is None:
                job = jobs[key] = replace(p.job, namespace=pod.namespace, pod=pod.name,
                                          container=container)
            named[pid] = evolve(p, job=job)
        if len(jobs) > 4 * len(named) + 64:  # the jobs of processes long gone
            jobs.clear()
        return MappingProxyType(named), pods

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
            if stat is None or (stat.state == ProcState.ZOMBIE and stat.threads <= 1):
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
                if not known.in_procfs or known.state == ProcState.ZOMBIE:
                    found[pid] = None
                elif known.start_time is not None:
                    found[pid] = known.start_time
                continue
            try:
                stat = self.processes.stat(pid)
            except (OSError, ValueError, IndexError):
                continue  # unreadable: left out, so no detector concludes it is gone
            alive = stat is not None and stat.state != ProcState.ZOMBIE
            found[pid] = stat.start_time if stat is not None and alive else None
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
                if (p := processes.get(pid)) is None or not p.in_procfs
                or p.state == ProcState.ZOMBIE
                or (p.start_time is not None and p.start_time > a.first_seen + 1)
                or (p.uid is not None and p.uid != a.uid)]
        if gone and self.agents is not None:
            self.agents.forget(gone)
        return {pid: a for pid, a in agents.items() if pid not in gone}

    def close(self) -> None:
        self.nvml.close()
        self.cgroup_memory.close()
        self.node_memory.close()
        stop = getattr(self.pods, "stop", None)
        if stop is not None:
            stop()
        close = getattr(self.processes, "close", None)
        if close is not None:
            close()
