"""stalled: an instrumented process whose step has not advanced while it holds GPU memory.

The trainer starved of data for ten minutes, a collective that never returns, a deadlock: the
GPU memory stays held and nothing moves. Only processes that report steps through the agent can
be judged, and one that said it finished is not stalled. The finding closes when steps resume.
"""

from __future__ import annotations

from collections.abc import Iterator

from gpuwatch.config import DetectorConfig
from gpuwatch.detectors.common import finding, is_protected
from gpuwatch.history import History
from gpuwatch.model import Finding, Kind, NodeSnapshot
from gpuwatch.units import clock_time

#: The kinds of finding this detector reports (a test runs it over scenarios and checks).
EMITS = frozenset({Kind.STALLED})


def detect(snapshot: NodeSnapshot, history: History, config: DetectorConfig
           ) -> Iterator[Finding]:
    for pid, agent in snapshot.agents.items():
        p = snapshot.processes.get(pid)
        if p is None or not p.holds_gpu or is_protected(p, config):
            continue
        if agent.finished_at is not None or agent.step_changed_at is None:
            continue
        if snapshot.taken_at - agent.step_changed_at < config.stall_after:
            continue
        yield finding(Kind.STALLED, "warning", p,
                      f"step {agent.step} has not advanced since "
                      f"{clock_time(snapshot.wall(agent.step_changed_at))} "
                      "while holding GPU memory")
