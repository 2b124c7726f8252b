"""Where a process's job hangs from: its launcher, found from the process tree.

A worker's job root is its parent (torchrun, a launch script, slurmstepd's task), climbed further
while the ancestors belong to the same job (same Slurm job, same run id). Never PID 1, a process
supervisor or a login shell: everything under those is not one job, and calling it one would turn
a user's editor into a "leftover" when their training run ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Optional

from gpuwatch.model import HostProcess, Job

#: Parents that adopt or supervise unrelated processes: init systems, container inits and shims,
#: service supervisors. A process directly under one of these is the root of its own job.
SUPERVISORS = frozenset({
    "systemd", "init", "tini", "dumb-init", "catatonit", "docker-init", "s6-svscan",
    "s6-supervise", "runsv", "runsvdir", "supervisord", "containerd-shim",
    "containerd-shim-runc-v2", "conmon", "crun", "runc",
})
SHELLS = frozenset({"bash", "sh", "zsh", "fish", "dash", "ksh", "tcsh", "csh"})
#: Programs that start the ranks of a distributed job themselves, by program name (the kernel's
#: name for a script run through its #! line is the script's) or by the Python module run with
#: `-m`. A worker directly under one of these may be under its own, live launcher.
LAUNCHERS = frozenset({
    "torchrun", "mpirun", "mpiexec", "mpiexec.hydra", "orterun", "prterun", "prte", "orted",
    "prted", "hydra_pmi_proxy", "horovodrun", "deepspeed", "accelerate", "srun", "slurmstepd",
    "raylet",
})
LAUNCHER_MODULES = frozenset({
    "torch.distributed.run", "torch.distributed.launch", "deepspeed.launcher.launch",
    "deepspeed.launcher.runner", "accelerate.commands.launch", "accelerate.commands.accelerate_cli",
})
#: Long-lived programs that start and end processes for many pieces of work, and outlive each:
#: a cluster manager and its agents, a notebook server and its kernels. A GPU holder under one
#: ending is one piece of work ending, not the tree's: the service's other children are live.
#: Names are only ever evidence that a tree is a service (it keeps its members from being
#: leftovers), never authority to end anything: see docs/findings.md, "How a leftover is told
#: from a service's child".
SERVICES = frozenset({
    # Ray: the per-node manager, the head's control store, their Python processes.
    "raylet", "gcs_server",
    # Jupyter: the servers (console scripts), a hub's single-user server, the kernels.
    "jupyter", "jupyter-lab", "jupyter-notebook", "jupyter-server", "jupyter-nbclassic",
    "jupyterhub", "jupyterhub-singleuser", "jupyter-kernel", "ipykernel_launcher",
})
SERVICE_MODULES = frozenset({
    "jupyter", "jupyterlab", "notebook", "nbclassic", "jupyter_server", "jupyterhub.singleuser",
    "ipykernel", "ipykernel_launcher", "jupyter_client.kernelapp", "ray.dashboard.agent",
})
#: Process titles Ray gives its workers and agents (setproctitle): `ray::IDLE`,
#: `ray::Actor.method`, `ray::DashboardAgent`, `ray::RuntimeEnvAgent`.
SERVICE_TITLE_PREFIXES = ("ray::",)
#: Where the Python programs of a Ray node live (default_worker.py, dashboard/agent.py,
#: runtime_env/agent/main.py, log_monitor.py): run as scripts, not with -m.
_SERVICE_SCRIPT_DIRS = ("/ray/_private/", "/ray/dashboard/", "/ray/autoscaler/")
# Guards the climb against a corrupt or cyclic parent chain.
_MAX_DEPTH = 64


def is_supervisor(p: HostProcess) -> bool:
    return p.pid == 1 or (p.name or "") in SUPERVISORS


def is_launcher(p: HostProcess) -> bool:
    """Whether `p` runs a distributed launcher (LAUNCHERS, LAUNCHER_MODULES)."""
    args = p.cmdline
    programs = {p.name or "", *(_base(a) for a in args[:2])}
    if programs & LAUNCHERS:
        return True
    for i, arg in enumerate(args[:-1]):
        if arg == "-m":
            return args[i + 1] in LAUNCHER_MODULES
    return False


def is_service(p: HostProcess) -> bool:
    """Whether `p` shows the shape of a known service (SERVICES, SERVICE_MODULES, a `ray::`
    title, a program of Ray's package): evidence that its tree is not one job, never a reason
    to act on it."""
    name = p.name or ""
    args = p.cmdline[:2]
    if name in SERVICES or name.startswith(SERVICE_TITLE_PREFIXES):
        return True
    for arg in args:
        if (_base(arg) in SERVICES or arg.startswith(SERVICE_TITLE_PREFIXES)
                or (arg.endswith(".py") and any(d in arg for d in _SERVICE_SCRIPT_DIRS))):
            return True
    for i, arg in enumerate(p.cmdline[:-1]):
        if arg == "-m":
            return p.cmdline[i + 1] in SERVICE_MODULES
    return False


def lineage(p: HostProcess, processes: Mapping[int, HostProcess]) -> Iterator[HostProcess]:
    """`p`, then its parent, its parent's parent, ... as `processes` has them: up to PID 1, or
    the first one `processes` lacks (at most _MAX_DEPTH: a corrupt or cyclic chain ends)."""
    current: Optional[HostProcess] = p
    for _ in range(_MAX_DEPTH):
        if current is None:
            return
        yield current
        if not current.ppid or current.ppid == current.pid:
            return
        current = processes.get(current.ppid)


def descendants(roots: Iterable[int], children_of: Callable[[int], Iterable[int]]
                ) -> set[int]:
    """Every process under `roots` (not the roots themselves), asking `children_of` once for
    each: from a children mapping, /proc's children files, or whatever else knows a process's
    children."""
    seen = set(roots)
    found: set[int] = set()
    todo = list(seen)
    while todo:
        for child in children_of(todo.pop()):
            if child not in seen:
                seen.add(child)
                found.add(child)
                todo.append(child)
    return found


def service_over(p: HostProcess, processes: Mapping[int, HostProcess],
                 observer: Optional[int] = None, itself: bool = True
                 ) -> Optional[HostProcess]:
    """The nearest of `p`'s ancestors that is a service (is_service) or the process `observer`
    names (the daemon), whose live work `p` is as far as anyone can tell; else, with `itself`,
    `p` where it is a service; else None. The reaper's own check before it ends a leftover or
    an orphan (gpuwatch.actions.reap_plan), whatever the findings say."""
    for q in lineage(p, processes):
        if q is not p and ((observer is not None and q.pid == observer) or is_service(q)):
            return q
    return p if itself and is_service(p) else None


def is_namespace_init(p: HostProcess, of: HostProcess) -> bool:
    """Whether `p` is PID 1 of the PID namespace `of` lives in: the process the kernel gives a
    process of that namespace when its parent exits and no subreaper is in between. NSpid says
    it: `p` is as deep in nested namespaces as `of`, and its innermost PID is 1 (a parent lives
    in its child's namespace or an outer one, so as deep means the same one)."""
    return (bool(p.namespace_pids) and p.namespace_pids[-1] == 1
            and len(p.namespace_pids) == len(of.namespace_pids))


def _base(program: str) -> str:
    return program.rsplit("/", 1)[-1]


def is_login_shell(p: HostProcess) -> bool:
    """An interactive or login shell leads its own session (ssh, a terminal, a tmux pane)."""
    return (p.name or "") in SHELLS and p.sid == p.pid


def _adopts(parent: HostProcess, job: Optional[Job]) -> bool:
    """Whether `parent` is a boundary a child of job `job` does not extend across."""
    if is_supervisor(parent):
        return True
    # A login shell is part of the job only when it is in the same scheduler job (sbatch's
    # batch script leads its session, and it is the job's launcher).
    return is_login_shell(parent) and (job is None or parent.job != job)


def _nothing_read(p: HostProcess) -> bool:
    """Whether /proc had nothing to say about what `p` runs: no command line, no environment
    (an exec in flight reads so, between the kernel dropping the old image and placing the new
    one's arguments; so does a zombie first seen after it exited). Its job is unknown, not none."""
    return p.job is None and not p.cmdline and not p.launch_env


def _job_of(p: HostProcess, processes: Mapping[int, HostProcess]) -> Optional[Job]:
    """`p`'s job, or where nothing was read of it its parent's: a child starts with its parent's
    environment, and the next poll reads what it execs. Taken as having no job, it would make its
    parent the root of a job of its own for a poll."""
    if not _nothing_read(p) or not p.ppid:
        return p.job
    parent = processes.get(p.ppid)
    return parent.job if parent is not None else None


def job_root(pid: int, processes: Mapping[int, HostProcess]) -> Optional[int]:
    """The process's launcher, and above it only ancestors of the same scheduler job.

    Climbing further on the tree alone would run into whatever started the launcher (a CI
    runner, an IDE, a test harness) and make the job swallow unrelated processes.
    """
    p = processes.get(pid)
    if p is None or not p.in_procfs or p.pid == 1:
        return None
    parent = processes.get(p.ppid) if p.ppid else None
    job = _job_of(p, processes)
    if parent is None or _adopts(parent, job):
        return pid
    root = parent
    for _ in range(_MAX_DEPTH):
        if job is None:
            break
        up = processes.get(root.ppid) if root.ppid else None
        if up is None or up.job != job or _adopts(up, root.job):
            break
        root = up
    return root.pid


def job_roots(processes: Mapping[int, HostProcess],
              known: Mapping[int, Optional[int]] = MappingProxyType({})) -> dict[int, int]:
    """Each process's job root. A launcher is the root of its own job: climbing from it alone
    would make whatever started it (a shell script, the demo, a CI runner) its launcher, and put
    torchrun in another job than its workers. A rank that started processes of its own (a data
    loader's workers) is not: it and they stay in its launcher's job (`_rank_of`).

    `known`: job_root of some of the processes, worked out already on the same records (a
    poll's, for its seeds), taken as they are."""
    roots: dict[int, int] = {}
    for pid in processes:
        root = known[pid] if pid in known else job_root(pid, processes)
        if root is not None:
            roots[pid] = root
    for root in set(roots.values()):
        if root in roots and not _rank_of(processes[root], roots[root], processes):
            roots[root] = root
    # A rank's own children (its data loader's workers, a helper it started) are its launcher's
    # job, as the rank is: climb to the root that is its own.
    for pid, root in roots.items():
        for _ in range(_MAX_DEPTH):
            up = roots.get(root, root)
            if up == root:
                break
            root = up
        roots[pid] = root
    return roots


def _rank_of(p: HostProcess, root: int, processes: Mapping[int, HostProcess]) -> bool:
    """Whether `p` was started by a distributed launcher (LAUNCHERS, LAUNCHER_MODULES), its
    parent and job root: a rank that starts processes of its own stays in its launcher's job,
    and `torchrun:<launcher PID>` names all of it. By the launcher's name only: a variable
    only a launcher sets, set by a parent no list holds (a CI runner, a custom wrapper), says
    too little of that parent's other children to put them in one job with the rank's."""
    parent = processes.get(p.ppid) if p.ppid else None
    return parent is not None and parent.pid == root != p.pid and is_launcher(parent)
