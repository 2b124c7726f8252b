"""The daemon's log of what instrumented processes left alive at interpreter exit.

An agent's exit report (non-daemon threads, live executors, a torch.distributed process group
never destroyed) is what keeps a finished trainer from exiting; the daemon says it once per
process, in its own log.
"""

from __future__ import annotations

import logging

from gpuwatch.model import NodeSnapshot
from gpuwatch.units import plural

# Lines of the daemon's log: they keep its logger's name.
log = logging.getLogger("gpuwatch.daemon")


class ExitReportLog:
    """Logs each process's exit report once; forgets a process once its agent is gone."""

    def __init__(self) -> None:
        self._exit_reported: set[int] = set()

    def log(self, snapshot: NodeSnapshot) -> None:
        """What an instrumented process left alive at exit, once per process."""
        for pid, agent in snapshot.agents.items():
            if agent.exit_report is None or pid in self._exit_reported:
                continue
            self._exit_reported.add(pid)
            exit_report = agent.exit_report
            left = [f"non-daemon thread {name!r}" for name in exit_report.get("threads", ())]
            if exit_report.get("executors"):
                left.append(plural(exit_report["executors"], "live executor"))
            if exit_report.get("process_group"):
                left.append("a torch.distributed process group never destroyed")
            if left:
                name = snapshot.processes[pid].name if pid in snapshot.processes else "?"
                log.warning("PID %d (%s) reached interpreter exit with %s still alive", pid,
                            name, ", ".join(left))
        self._exit_reported &= set(snapshot.agents)
