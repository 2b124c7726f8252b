"""What the history keeps of each job tree over the polls: its members, its trainers (the
members that held GPU memory), its launchers and what they launched, and when its last trainer
was found gone (what is still alive after that is a leftover)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Optional, Protocol

from gpuwatch.jobs.key import JobKey
from gpuwatch.launch_env import (
    RAY_JOB_SOURCE,
    TORCHELASTIC_DEFAULT_RUN_ID,
    TORCHELASTIC_RUN_ID_KEY,
    TORCHRUN_JOB_SOURCE,
    process_title,
)
from gpuwatch.model import HostProcess, Job, NodeSnapshot
from gpuwatch.vocabulary import ProcState

#: A process's identity: its PID and start time (HostProcess.identity).
Identity = tuple[int, Optional[float]]
#: Guards a climb up the process tree against a corrupt or cyclic parent chain.
_MAX_CLIMB = 64


class Member(Protocol):
    """What the history keeps of a process that places it in a tree."""

    @property
    def job_key(self) -> Optional[JobKey]: ...

    @property
    def first_ppid(self) -> Optional[int]: ...


@dataclass
class JobRecord:
    """A group of processes hanging from one launcher (gpuwatch.jobs.tree)."""

    key: JobKey
    root_pid: int
    root_name: Optional[str]
    label: Optional[Job]
    members: set[Identity] = field(default_factory=set)
    #: Members that held GPU memory while watched, alive now.
    trainers: set[Identity] = field(default_factory=set)
    had_trainer: bool = False
    #: When the last trainer was found gone (None while one lives, or if none ever did).
    finished_at: Optional[float] = None
    last_trainer: Optional[tuple[int, Optional[str]]] = None
    #: The last trainer's kernel name (`comm`), for a finding's summary: `last_trainer` names it
    #: as a sentence does (launch_env.process_title), from its command line.
    last_trainer_comm: Optional[str] = None
    #: The root as first seen.
    root: Optional[HostProcess] = None
    #: The launch variables (launch_env.LAUNCH_ENV_KEYS, names only) its trainers carried.
    trainer_env: frozenset[str] = frozenset()
    #: Of those, the ones a trainer's parent did not carry: its parent set them, as a
    #: launcher's agent does for each rank it starts (inherited ones say nothing of who).
    launcher_set_env: frozenset[str] = frozenset()
    #: A trainer told the agent it finished (agent.finished()).
    agent_finished: bool = False
    #: The processes that started its trainers (each trainer's parent, where that is a member
    #: of the job), as first seen: whether one was a launcher still shows once it has exited.
    launchers: dict[Identity, HostProcess] = field(default_factory=dict)
    #: Members seen under a trainer or a trainer's launcher, while that one ran: the nearest
    #: such ancestor. Kept after they are reparented. Only these can be the job's leftovers:
    #: what else shares the tree (a login shell's editor in a Slurm allocation) was started
    #: by something else.
    launched_by: dict[Identity, Identity] = field(default_factory=dict)


class JobTrees:
    """The job trees seen, by key."""

    def __init__(self) -> None:
        self._jobs: dict[JobKey, JobRecord] = {}
        #: Whom each job's last_trainer names (PID, name, command line): named again only
        #: when another process, or another program, is its last trainer.
        self._titled: dict[JobKey, tuple[int, Optional[str], tuple[str, ...]]] = {}
        #: Each trainer's job and environments, and its parent's, as last noted (_note_trainer).
        self._noted: dict[Identity, tuple[JobRecord, object, object]] = {}

    def get(self, key: Optional[JobKey]) -> Optional[JobRecord]:
        return self._jobs.get(key) if key is not None else None

    def __iter__(self) -> Iterator[JobRecord]:
        return iter(self._jobs.values())

    def watch_pids(self) -> set[int]:
        """Members of jobs that have had trainers: read them every poll, even reparented."""
        return {pid for job in self._jobs.values() if job.had_trainer
                for pid, _ in job.members}

    def update(self, snapshot: NodeSnapshot,
               recorded: Iterable[tuple[HostProcess, Identity, Optional[Member]]]) -> None:
        """Each tree's members and trainers as `snapshot` has them, `recorded` giving each of
        its processes the history keeps, in the snapshot's order, with its identity and what
        the history keeps of it (the tree it was first seen in); a tree with no member left is
        forgotten."""
        now = snapshot.taken_at
        # A GPU whose holders are unknown (its process lists unread, or no handle to ask them
        # of) hides them: a trainer last seen holding stays a trainer while alive, or a driver
        # fault would turn every job's helpers into leftovers once it outlasted the grace.
        blind = not snapshot.nvml.available or any(g.holders_unknown for g in snapshot.gpus)
        last_trainers: dict[JobKey, set[Identity]] = {}
        for job in self._jobs.values():
            if blind:
                last_trainers[job.key] = set(job.trainers)
            job.members.clear()
            job.trainers.clear()
        trainers: list[tuple[JobRecord, HostProcess]] = []
        last: dict[JobKey, HostProcess] = {}
        jobs, agents = self._jobs, snapshot.agents
        for p, identity, h in recorded:
            if h is None or h.job_key is None:
                continue
            job = jobs.get(h.job_key) or self._new(h.job_key, snapshot)
            job.members.add(identity)
            if job.label is None:
                job.label = _tree_label(p, h, job)
            agent = agents.get(p.pid) if agents else None
            done = agent is not None and agent.finished_at is not None
            holds = bool(p.gpu_usage) or identity in last_trainers.get(job.key, ())
            if p.state == ProcState.ZOMBIE:
                continue
            if done:
                job.agent_finished = True
            # A holder that said it finished before any poll saw it hold memory (a daemon
            # started late) trained all the same: the job's trainer, noted as one, not live.
            if holds and (not done or not job.had_trainer):
                if not done:
                    job.trainers.add(identity)
                job.had_trainer = True
                last[job.key] = p
                trainers.append((job, p))
        noted, self._noted = self._noted, {}
        for job, p in trainers:  # once every member is known, its parent included
            self._note_trainer(job, p, snapshot, noted)
        titled = self._titled
        for key, p in last.items():  # each job's last trainer in this poll's order, named once
            was = titled.get(key)
            if was is None or was[0] != p.pid or was[1] is not p.name or was[2] is not p.cmdline:
                job = self._jobs[key]
                job.last_trainer = (p.pid, process_title(p.name, p.cmdline))
                job.last_trainer_comm = p.name
                titled[key] = (p.pid, p.name, p.cmdline)
        for key in [k for k, job in self._jobs.items() if not job.members]:
            del self._jobs[key]
            titled.pop(key, None)
        for job in self._jobs.values():
            if job.had_trainer:
                _mark_launched(job, snapshot)
        for job in self._jobs.values():
            if job.trainers:
                job.finished_at = None
            elif job.had_trainer and job.finished_at is None:
                job.finished_at = now

    def _new(self, key: JobKey, snapshot: NodeSnapshot) -> JobRecord:
        root = snapshot.processes.get(key.root_pid)
        job = self._jobs[key] = JobRecord(key, key.root_pid, root.name if root else None, None,
                                          root=root)
        return job

    def _note_trainer(self, job: JobRecord, p: HostProcess, snapshot: NodeSnapshot,
                      noted: dict[Identity, tuple[JobRecord, object, object]]) -> None:
        """What a live trainer shows of the job: its launch variables, those its parent lacks,
        and its parent as the job's launcher where that is a member of the job. (The variables
        are added to the job's once for the same trainer, parent environment and job: `noted`,
        the last poll's.)"""
        parent = snapshot.processes.get(p.ppid) if p.ppid else None
        env = p.launch_env
        parent_env = parent.launch_env if parent is not None else None
        was = noted.get(p.identity)
        if was is None or was[0] is not job or was[1] is not env or was[2] is not parent_env:
            keys = env.keys()
            if not job.trainer_env >= keys:
                job.trainer_env = job.trainer_env | keys
            parent_keys = parent_env.keys() if parent_env is not None else frozenset()
            if not job.launcher_set_env >= keys - parent_keys:
                job.launcher_set_env = job.launcher_set_env | (keys - parent_keys)
        self._noted[p.identity] = (job, env, parent_env)
        if (parent is not None and parent.identity in job.members
                and parent.identity not in job.launchers):
            job.launchers[parent.identity] = parent


def _tree_label(p: HostProcess, h: Member, job: JobRecord) -> Optional[Job]:
    """The label a member gives its job tree: its own job, but never a Ray job (one raylet
    serves many, so the raylet and its idle workers belong to none of them), and for a worker
    torchrun started without a run id (TORCHELASTIC_RUN_ID=none: `accelerate launch`, torchrun
    without --rdzv-id) the launcher that started it, the tree's root: `torchrun:<its PID>`.
    The tree itself is keyed by the launcher's PID and start time, so a PID reused later starts
    another tree."""
    if p.job is not None:
        return p.job if p.job.source != RAY_JOB_SOURCE else None
    if (h.first_ppid == job.root_pid and job.root_pid != p.pid
            and p.launch_env.get(TORCHELASTIC_RUN_ID_KEY, "").strip()
            == TORCHELASTIC_DEFAULT_RUN_ID):
        return Job(str(job.root_pid), TORCHRUN_JOB_SOURCE)
    return None


def _mark_launched(job: JobRecord, snapshot: NodeSnapshot) -> None:
    """Mark the members now under one of the job's live trainers or launchers (the nearest one
    above each), and forget the marks of members gone."""
    procs = snapshot.processes
    # (Its trainers are this snapshot's processes: only a launcher may have gone.)
    anchors = job.trainers.union(i for i in job.launchers
                                 if (a := procs.get(i[0])) is not None and a.identity == i)
    launched = job.launched_by
    for identity in [i for i in launched if i not in job.members]:
        del launched[identity]
    if not anchors:
        return
    for identity in job.members:
        if identity in launched:
            continue
        p = procs.get(identity[0])
        for _ in range(_MAX_CLIMB):
            up = procs.get(p.ppid) if p is not None and p.ppid else None
            if up is None or up.identity not in job.members:
                break
            if up.identity in anchors:
                launched[identity] = up.identity
                break
            p = up
