"""The process trees every view draws: which processes a view shows (each GPU holder, each
process with a finding, with its chain up to its job root and the job trees under them), the trees
walked depth first, and the cells of a process's row.

Pure: a node report in, PIDs, branches and cells out. `gpuwatch status` (status_view) and
`gpuwatch top` (top/view) draw the same trees from here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

from gpuwatch.jobs.tree import descendants
from gpuwatch.launch_env import WORKER_MARKER_KEYS
from gpuwatch.model import HostProcess, Job, NodeReport, holds_gpu
from gpuwatch.units import human_bytes, short_command


def no_holders_sentence(report: NodeReport) -> str:
    """What to say when no process is shown: nothing holds GPU memory, or who does is unknown
    (a GPU's process list could not be read), or, without NVML, nothing looks like GPU work."""
    snapshot = report.snapshot
    unread = [str(g.index) for g in snapshot.gpus if g.holders_unknown]
    if snapshot.nvml.available and unread:
        return (f"process list unreadable on GPU {', '.join(unread)}: who holds its memory is "
                "unknown")
    return ("no process holds GPU memory" if snapshot.nvml.available
            else "no process looks like GPU work (no /dev/nvidia* holder, no rank variables)")


def shown_pids(report: NodeReport, flagged: set[int]) -> set[int]:
    """Each GPU holder (and each process with a finding) with its chain up to its job root, and
    every process the report holds under these (the job trees' members without GPU memory).

    Without NVML the report holds look-alike GPU workers instead of holders: processes whose
    environment carries distributed-worker variables.
    """
    snapshot = report.snapshot
    procs = snapshot.processes
    nvml_available = snapshot.nvml.available
    blind = snapshot.blind_gpus
    shown: set[int] = set()
    for p in procs.values():
        # holds_gpu None: a holder of its GPU's last good read, unknown now; shown, with "?".
        seed = (holds_gpu(p, blind) is not False or not p.in_procfs) if nvml_available else (
            not WORKER_MARKER_KEYS.isdisjoint(p.launch_env))
        if not (seed or p.pid in flagged):
            continue
        shown.add(p.pid)
        root, current = snapshot.job_roots.get(p.pid), p
        while current is not None and current.pid != root and current.ppid in procs:
            current = procs[current.ppid]
            if current.pid == 1:
                break
            shown.add(current.pid)
    # And everything under them: the job trees' other members (a data loader's workers, a
    # helper, a launcher's other children) hold no GPU memory, yet their memory is the job's
    # and they are judged with it. The report holds them because the poll reads the job trees.
    children: dict[int, list[int]] = {}
    for p in procs.values():
        if p.ppid and p.pid != 1:
            children.setdefault(p.ppid, []).append(p.pid)
    return shown | descendants(shown, lambda pid: children.get(pid, ()))


def walk_trees(procs: Mapping[int, HostProcess], shown: set[int],
               key: Optional[Callable[[int], Any]] = None
               ) -> Iterable[tuple[str, HostProcess]]:
    """Each tree depth first, as (prefix drawing its branch, process); roots and siblings in
    PID order, or by `key` (`gpuwatch top` sorts by a figure, keeping the trees whole)."""
    children: dict[int, list[int]] = {}
    for pid in shown:
        children.setdefault(procs[pid].ppid or 0, []).append(pid)
    roots = sorted((pid for pid in shown if procs[pid].ppid not in shown), key=key)

    def walk(pid: int, prefix: str, is_last: bool, is_root: bool
             ) -> Iterable[tuple[str, HostProcess]]:
        branch = "" if is_root else ("└─ " if is_last else "├─ ")
        yield prefix + branch, procs[pid]
        kids = sorted(children.get(pid, ()), key=key)
        below = prefix + ("" if is_root else ("   " if is_last else "│  "))
        for i, kid in enumerate(kids):
            yield from walk(kid, below, i == len(kids) - 1, False)

    for root in roots:
        yield from walk(root, "", True, True)


def job_cell(job: Optional[Job]) -> str:
    """source:id, or for a Kubernetes pod whose names are known NAMESPACE/POD[/CONTAINER]."""
    return job.shown if job else "-"


def gpu_cell(p: HostProcess) -> str:
    if not p.gpu_usage:
        return "-"
    return " ".join(f"{u.gpu_index}:{human_bytes(u.memory_bytes)}" for u in p.gpu_usage)


def command_cell(p: HostProcess, procs: Mapping[int, HostProcess], shown: set[int]) -> str:
    if not p.in_procfs:
        return "(not in /proc: exited, or another PID namespace)"
    command = short_command(p.name, p.cmdline)
    ppid = p.ppid
    if ppid and ppid not in shown:
        parent = procs.get(ppid)
        command += f"  (parent {ppid} {parent.name if parent else '?'})"
    return command
