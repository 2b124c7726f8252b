"""Which processes get per-process series on /metrics, under exporter.max_process_series and
agent.max_series_per_user: those that matter (GPU holders, processes with findings, agent
reporters), each user kept to a fair share of the room, so that one user's flood of processes or
fake findings takes no other user's series."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from gpuwatch.agent_budget import fair_shares
from gpuwatch.model import HostProcess, NodeReport

#: Why a process that mattered got no per-process series (the `reason` label of
#: gpuwatch_process_series_dropped_total): its user was over its share while another user's
#: processes all fit (`user_share`), or the cap left every user short (`max_process_series`:
#: raise it).
SERIES_DROPPED_REASONS = ("max_process_series", "user_share")


def dropped_by_cap(report: NodeReport, cap: int) -> dict[str, int]:
    """How many processes that mattered exported_processes leaves out, by reason."""
    return exported_processes(report, cap)[1]


def exported_processes(report: NodeReport, cap: int
                       ) -> tuple[list[HostProcess], dict[str, int]]:
    """The processes that get per-process series under exporter.max_process_series, in
    processes_that_matter's order, and those left out by reason (SERIES_DROPPED_REASONS).

    While they fit, all of them. When the cap binds, GPU holders come first, then the rest
    (findings, agent reporters), and within each tier the room left is shared by user, by
    max-min fairness: every user keeps all of its processes up to an even share, and what users
    below it leave goes to the others, evenly; a user's own processes are kept in
    processes_that_matter's order. One user's flood of reporting processes (or of findings it
    can raise against itself) thus never takes another user's series."""
    matter = processes_that_matter(report)
    dropped = dict.fromkeys(SERIES_DROPPED_REASONS, 0)
    if len(matter) <= cap:
        return matter, dropped
    kept: set[int] = set()
    room = cap
    for tier in ([p for p in matter if p.holds_gpu], [p for p in matter if not p.holds_gpu]):
        by_user: dict[Optional[int], list[HostProcess]] = {}
        for p in tier:
            by_user.setdefault(p.uid, []).append(p)
        shares = fair_shares({uid: len(ps) for uid, ps in by_user.items()}, room)
        for ps in by_user.values():
            share = shares[ps[0].uid]
            kept.update(p.pid for p in ps[:share])
            room -= min(share, len(ps))
    short = {p.uid for p in matter if p.pid not in kept}
    # A user left short while another user kept all of its processes was over its share.
    over = len(short) < len({p.uid for p in matter})
    for p in matter:
        if p.pid not in kept:
            dropped["user_share" if over else "max_process_series"] += 1
    return [p for p in matter if p.pid in kept], dropped


def agent_series_cap(report: NodeReport, processes: Iterable[HostProcess], cap: int
                     ) -> tuple[dict[int, int], int]:
    """The per-user cap on series from instrumented processes (agent.max_series_per_user).

    Counted per user (the kernel's UID of the reports): each process's agent series (its step
    and step time, and its RSS and start time when it matters only as a reporter), then its
    buffers' series in the order it reports them, over `processes` in their order (those with
    findings first). Returns {pid: buffers that get series, or -1 when none of its agent
    series fits} for the instrumented ones, and how many series the cap left out."""
    agents = report.snapshot.agents
    flagged = {f.pid for f in report.findings if f.pid is not None}
    room: dict[int, int] = {}
    allowed: dict[int, int] = {}
    dropped = 0
    for p in processes:
        agent = agents.get(p.pid)
        if agent is None:
            continue
        base = 0
        if agent.step is not None:
            base += 1 + (agent.step_changed_at is not None)
        if not (p.holds_gpu or p.pid in flagged):
            base += (p.rss_bytes is not None) + (p.start_time is not None)
        buffers = ([(size.items is not None) + (size.bytes is not None)
                    for size in agent.latest.buffers.values()]
                   if agent.latest is not None else [])
        left = room.get(agent.uid, cap)
        if left < base:
            allowed[p.pid] = -1
            dropped += base + sum(buffers)
            continue
        left -= base
        fit = 0
        for n in buffers:
            if n > left:
                break
            left -= n
            fit += 1
        dropped += sum(buffers[fit:])
        allowed[p.pid] = fit
        room[agent.uid] = left
    return allowed, dropped


def processes_that_matter(report: NodeReport) -> list[HostProcess]:
    """Processes that get per-process series: GPU holders, processes with findings and agent
    reporters; those with findings first, then the most GPU memory (within a user's share,
    exported_processes keeps the first)."""
    flagged = {f.pid for f in report.findings if f.pid is not None}
    agents = report.snapshot.agents
    chosen = [p for p in report.snapshot.processes.values()
              if p.holds_gpu or p.pid in flagged or p.pid in agents]
    return sorted(chosen, key=lambda p: (p.pid not in flagged, -(p.gpu_memory_bytes or 0),
                                         -(p.rss_bytes or 0), p.pid))
